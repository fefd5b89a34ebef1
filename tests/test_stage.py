"""A Stage in this process: its state digest, and the phase hook it calls (the seam fault injection fills)."""

import os
import pickle

import pytest
import torch

from raytrain.api import prepare
from raytrain.config.mesh import Mesh
from raytrain.data import even_shares
from raytrain.driver.rendezvous import RendezvousStore
from raytrain.config.prepared import Slot, WorkerSpec
from raytrain.data.samples import DataSource, SampleSpec
from raytrain.data.shards import one_file
from raytrain.reports.ack import ReplyAck
from raytrain.worker import phases
from raytrain.worker.phases import PhaseHook, phase_hook
from raytrain.worker.stage import Stage


@pytest.fixture
def keep_torch_threads():
    """A Stage sets torch's thread count for its worker process; give this process its own back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _stage(cfg, **kwargs) -> Stage:
    source = DataSource(one_file("unused: no join", 1), SampleSpec.tokens(cfg.model.seq_len))  # it reads no samples
    spec = WorkerSpec(cfg=cfg, source=source, num_samples=1, stage_layers=[[list(range(cfg.model.gpt_layers))]])
    return Stage(spec, Slot(0), **kwargs)


def test_state_digest_is_equal_for_equal_state_and_changes_with_any_value(make_config, keep_torch_threads):
    cfg = make_config()
    a, b = _stage(cfg), _stage(cfg)
    assert a.state_digest() == b.state_digest()  # the same seed builds the same layers
    a.optimizer.step()  # zero gradients: AdamW creates its state and decays the weights alike
    b.optimizer.step()
    assert a.state_digest() == b.state_digest()
    weight = b.params[-1].view(-1)
    with torch.no_grad():
        weight[0] += 1e-6
    assert a.state_digest() != b.state_digest()
    with torch.no_grad():
        weight[0] = a.params[-1].view(-1)[0]
    assert a.state_digest() == b.state_digest()
    b.optimizer.state[b.params[0]]["exp_avg"].view(-1)[0] = 1.0  # optimizer state counts
    assert a.state_digest() != b.state_digest()
    a.optimizer.state[a.params[0]]["exp_avg"].view(-1)[0] = 1.0
    assert a.state_digest() == b.state_digest()
    a.committed = 1  # and so does the step
    assert a.state_digest() != b.state_digest()


class Recorder(PhaseHook):
    def __init__(self):
        self.calls = []

    def __call__(self, phase, step, file=None):
        self.calls.append((phase, step, file))


def test_the_stage_calls_its_hook_at_every_phase_point(make_config, tmp_path, keep_torch_threads):
    # pp=1 dp=1: one process, a world of one; generation 1 so the join counts as a repair's.
    prepared = prepare(make_config("train.steps=1"))
    cfg = prepared.cfg
    recorder, armed = Recorder(), []

    def make_hook(specs, replica, stage_index, shard):
        armed.append((specs, replica, stage_index, shard))
        return recorder

    stage = Stage(prepared.worker_spec(), Slot(0), make_hook=make_hook)
    rendezvous = RendezvousStore()
    try:
        stage.join(0, Mesh(), even_shares(cfg.train.global_batch, 1),
                   rendezvous.address("127.0.0.1", "hooks"), generation=1, faults=["0:0@7:forward"])
        assert stage.run_step(0).ok
        stage.save(str(tmp_path))
    finally:
        stage.shutdown()
        rendezvous.close()
    assert armed == [(["0:0@7:forward"], 0, 0, 0)]
    shard = os.path.join(str(tmp_path), "stage-0.pt")
    assert recorder.calls == [("join", 0, None), ("data", 0, None), ("forward", 0, None), ("backward", 0, None), ("allreduce", 0, None),
                              ("optimizer", 0, None), ("checkpoint", 1, shard)]


# --- the phase hook ---------------------------------------------------------------------------------


class Killed(Exception):
    pass


@pytest.fixture
def no_kill(monkeypatch):
    def kill_self():
        raise Killed

    monkeypatch.setattr(phases, "kill_self", kill_self)


def test_phase_hook_fires_only_for_its_slot_step_and_phase(no_kill):
    assert type(phase_hook(["1:0@3:backward"], 0, 0)) is PhaseHook  # not this worker's: does nothing
    hook = phase_hook(["1:0@3:backward"], 1, 0)
    hook("forward", 3)
    hook("backward", 2)
    with pytest.raises(Killed):
        hook("backward", 3)


def test_checkpoint_fault_tears_the_shard_then_kills(no_kill, tmp_path):
    hook = phase_hook(["0:1@4:checkpoint"], 0, 1)
    shard = str(tmp_path / "stage-1.pt")
    with pytest.raises(Killed):
        hook("checkpoint", 4, file=shard)
    assert open(shard, "rb").read() == b"half a shard"


def test_step_fault_waits_until_the_caller_has_read_the_previous_reply(no_kill):
    hook = phase_hook(["0:0@3:forward"], 0, 0)
    assert type(hook.reply(1, {"step": 1})) is dict  # no fault in step 2: the reply as it is
    reply = hook.reply(2, {"step": 2, "ok": True})
    read = pickle.loads(pickle.dumps(reply))  # as the caller's ray.get deserialises it
    assert type(read) is dict and read == {"step": 2, "ok": True}
    with pytest.raises(Killed):
        hook("forward", 3)  # returns from the wait at once: the reply was read


def test_an_unread_reply_is_not_acknowledged():
    ack = ReplyAck()
    ack.attach({"step": 2})
    assert ack.wait(0.05) is False


def test_ray_serialisation_runs_the_acknowledgement(ray_session):
    # Ray packs results with msgpack (strict types) and pickles what msgpack does not take: a dict
    # subclass must reach pickle, or the caller would never acknowledge.
    ack = ReplyAck()
    ref = ray_session.put(ack.attach({"step": 0}))
    assert ray_session.get(ref) == {"step": 0}
    assert ack.wait(5.0)


def test_a_background_write_begins_when_released_and_reports_its_result_or_its_error():
    """The write of a background save waits for the worker's next step (``release``), so the call that
    started it has answered before anything of the write can fail; its error is reported, not raised."""
    import threading

    from raytrain.reports import ShardReport
    from raytrain.worker.saving import BackgroundWriter

    writer, began = BackgroundWriter(), threading.Event()

    def write():
        began.set()
        return ShardReport(entry={"file": "stage-0.pt", "bytes": 1}, finite=True)

    writer.start("ckpt/step_00000002", write)
    assert not began.wait(0.2) and writer.finished() is None  # not before release
    writer.release()
    assert writer.wait().shard.entry["file"] == "stage-0.pt" and writer.finished().ckpt_dir == "ckpt/step_00000002"

    def fail():
        raise OSError("disk full")

    writer.start("ckpt/step_00000004", fail)
    assert writer.wait().error == "OSError: disk full"


def test_a_worker_imports_torch_with_the_collector_paused_and_freezes_what_it_imported():
    """In a fresh interpreter, as a worker process starts: afterwards the collector runs again, and the
    imported objects (hundreds of thousands) are frozen, so a full collection does not walk them."""
    import subprocess
    import sys

    child = ("import gc, sys\n"
             "from raytrain.worker.actor import import_torch_uncollected\n"
             "assert 'torch' not in sys.modules\n"
             "import_torch_uncollected()\n"
             "print(gc.isenabled(), gc.get_freeze_count(), 'torch._dynamo' in sys.modules, "
             "'raytrain.worker.stage' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120, check=True)
    enabled, frozen, dynamo, stage = out.stdout.split()
    assert (enabled, dynamo, stage) == ("True", "True", "True")
    assert int(frozen) > 100_000
