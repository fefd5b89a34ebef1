"""The worker protocol is one typed interface: the Ray worker group and the tests' fake implement the
same methods with the same signatures, and every call the Ray group makes names a method of the
worker actor with arguments it accepts. A protocol change that misses one side fails here, not in a
run that reaches the call."""

import ast
import inspect
from pathlib import Path

import pytest

from raytrain.control.protocol import WorkerGroup
from raytrain.control.workergroup import RayWorkerGroup
from raytrain.worker.actor import StageWorker
from tests.helpers import FakeWorkerGroup

WORKERGROUP_SOURCE = Path(inspect.getfile(RayWorkerGroup))
PROTOCOL = sorted(WorkerGroup.__abstractmethods__)


def _shape(fn) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("group", [RayWorkerGroup, FakeWorkerGroup])
def test_both_worker_groups_implement_the_whole_protocol(group):
    assert issubclass(group, WorkerGroup) and not inspect.isabstract(group)
    for name in PROTOCOL:
        assert _shape(getattr(group, name)) == _shape(getattr(WorkerGroup, name)), f"{group.__name__}.{name}"


def test_the_protocol_covers_every_worker_call():
    assert len(PROTOCOL) >= 17, PROTOCOL
    assert {"join", "save", "load", "evaluate", "send_step", "send_commit_prepared", "collect"} <= set(PROTOCOL)


def _actor_calls() -> list[tuple[str, int, int]]:
    """(actor method, positional arguments, line) of every ``<member>.handle.<method>.remote(...)``."""
    calls = []
    for node in ast.walk(ast.parse(WORKERGROUP_SOURCE.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "remote"
                and isinstance(node.func.value, ast.Attribute)
                and isinstance(node.func.value.value, ast.Attribute) and node.func.value.value.attr == "handle"):
            calls.append((node.func.value.attr, len(node.args), node.lineno))
    return calls


def test_every_call_of_the_ray_group_names_a_worker_method_with_arguments_it_takes():
    calls = _actor_calls()
    assert {name for name, _, _ in calls} >= {"join", "sync_state", "skip_step", "evaluate", "save", "load",
                                                "state_digest", "run_step", "commit_prepared", "leave"}
    for name, args, line in calls:
        method = getattr(StageWorker, name, None)
        assert callable(method), f"workergroup.py:{line} calls {name}, which StageWorker does not have"
        inspect.signature(method).bind(None, *range(args))  # raises TypeError when the arity is wrong


def test_no_worker_method_is_called_by_a_computed_name():
    tree = ast.parse(WORKERGROUP_SOURCE.read_text())
    computed = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "getattr" and not isinstance(node.args[1], ast.Constant)]
    assert computed == []


def test_the_worker_replies_with_report_dataclasses():
    hints = {name: inspect.signature(getattr(StageWorker, name)).return_annotation
             for name in ("join", "run_step", "evaluate", "save")}
    assert hints == {"join": "JoinReport", "run_step": "StepReport", "evaluate": "EvalReport", "save": "ShardReport"}
