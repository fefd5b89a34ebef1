"""Where a sweep's Tune experiment lives: a new sweep's directory, known before Tune starts, and the
directory ``--resume`` names, checked before Ray starts, restored with a one-line error when it cannot be.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import TYPE_CHECKING

from raytrain.tune.sweep_config import SweepConfig

if TYPE_CHECKING:
    from ray import tune


def named(sweep: SweepConfig) -> SweepConfig:
    """The sweep with its experiment name fixed now, so its directory is known before Tune starts."""
    return sweep if sweep.name else dataclasses.replace(sweep, name=new_name())


def new_name() -> str:
    """A new experiment's default name: the time it starts."""
    return time.strftime("sweep-%Y%m%d-%H%M%S")


def storage_dir(sweep: SweepConfig) -> str:
    """``sweep.storage_path`` as an absolute local path: where Tune keeps the sweep's experiment."""
    return os.path.abspath(os.path.expanduser(sweep.storage_path))


def planned_dir(sweep: SweepConfig) -> str:
    """Where Tune keeps a new sweep's experiment (``sweep.name`` must be set: see ``named``)."""
    return os.path.join(storage_dir(sweep), sweep.name)


def experiment_dir(path: str) -> str:
    """A ``--resume`` path as Tune's restore needs it: a URI as given; a local path (relative, ``~``)
    absolute, because Tune reads a relative path as a URI without a scheme."""
    if "://" in path:
        return path
    return os.path.abspath(os.path.expanduser(path))


def resumable_dir(path: str) -> str:
    """The experiment directory ``--resume path`` names, or a one-line ValueError saying what to pass."""
    from ray import tune  # here: the CLI checks --resume before it imports Ray Tune's trainers and torch

    where = experiment_dir(path)
    if tune.Tuner.can_restore(where):
        _check_tuner_state(path, where)
        return where
    fix = "pass the 'experiment' directory a sweep printed (runs/sweeps/<name>)"
    if os.path.isdir(where):
        inside = sorted(d for d in os.listdir(where) if tune.Tuner.can_restore(os.path.join(where, d)))
        if inside:
            fix = f"it holds the sweeps {', '.join(inside)}: pass one of them, e.g. {os.path.join(path, inside[-1])}"
        what = "holds no Ray Tune experiment (no tuner.pkl)"
    else:
        what = "does not exist"
    raise ValueError(f"--resume {path}: {where} {what}; {fix}")


def restore(path: str, where: str, trainable) -> "tune.Tuner":
    """Tune's tuner of the experiment at ``where`` (``resumable_dir(path)``), to run its unfinished and
    errored trials; a state Tune cannot load is a one-line ValueError, not Tune's traceback."""
    from ray import tune

    try:
        return tune.Tuner.restore(where, trainable, resume_unfinished=True, resume_errored=True)
    except Exception as e:  # a damaged experiment state
        raise _cannot_restore(path, where, e) from None


def _check_tuner_state(path: str, where: str) -> None:
    """A local experiment's ``tuner.pkl`` must unpickle, which Tune finds out only after Ray started.
    Tune unpickles that file on restore anyway: reading it here trusts it no more than before."""
    state = os.path.join(where, "tuner.pkl")
    if "://" in where or not os.path.isfile(state):
        return
    import ray.cloudpickle

    try:
        with open(state, "rb") as f:
            ray.cloudpickle.load(f)
    except Exception as e:
        raise _cannot_restore(path, where, e) from None


def _cannot_restore(path: str, where: str, error: Exception) -> ValueError:
    """The one line for an experiment whose saved state does not load: the first line of why."""
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return ValueError(f"--resume {path}: {where} holds a sweep Tune cannot restore ({first}); "
                      "start it again without --resume")
