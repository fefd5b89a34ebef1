"""A step's vote: in a purely data-parallel generation it is summed with the gradients (one collective
fewer per step), and it decides what the world-wide vote decides."""

import json
import os

import pytest
import torch
from torch import nn

from raytrain.config import load_config
from raytrain.config.mesh import Mesh
from raytrain.config.prepared import Slot
from raytrain.data import even_shares
from raytrain.driver.prepare import prepare
from raytrain.driver.rendezvous import RendezvousStore
from raytrain.worker.groups import Groups
from raytrain.worker.stage_layers import stage_layers
from tests.factories import INFINITE_LOSS_ENV
from tests.forked_stages import run_forked


def _vote_in_the_buckets(rank: int, world: int, store, loss: float, leaving: bool, out_dir: str) -> None:
    """One step of a two-layer model's bucketed all-reduce with this rank's vote in it; writes what it decided."""
    import torch.distributed as dist

    from raytrain.worker.gradsync import GradientBuckets

    client = dist.TCPStore(store.host, store.port, is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore(store.namespace, client), rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    params = list(model.parameters())
    # 40 bytes a bucket: several buckets, the vote in the first one to fill (the last layer's)
    grads = GradientBuckets(params, dist.group.WORLD, bucket_bytes=40)
    grads.zero()
    grads.open_vote(lambda: leaving)
    out = model(torch.full((1, 3), float(rank + 1))).sum()
    grads.arm(torch.tensor(loss))
    out.backward()
    grads.finish()
    finite, leaves = grads.vote_result()
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump({"finite": finite, "leaves": leaves, "squared_norm": float(grads.squared_norm()),
                   "grads_squared": float(sum(p.grad.pow(2).sum() for p in params)),
                   "buckets": len(grads.buffers)}, f)
    dist.destroy_process_group()


@pytest.mark.parametrize("losses, leaving, expected", [
    ((1.5, 2.0), (False, False), (True, False)),
    ((float("nan"), 2.0), (False, True), (False, True)),  # one worker's NaN and another's leaving reach everyone
    ((1.0, float("inf")), (False, False), (False, False)),
])
def test_the_vote_summed_with_the_gradients_reaches_every_worker_alike(tmp_path, losses, leaving, expected):
    rendezvous = RendezvousStore()
    store = rendezvous.address("127.0.0.1", namespace="vote/")
    try:
        run_forked(_vote_in_the_buckets, [(rank, 2, store, losses[rank], leaving[rank], str(tmp_path))
                                          for rank in range(2)])
    finally:
        rendezvous.close()
    decided = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]
    assert [(d["finite"], d["leaves"]) for d in decided] == [expected, expected]
    assert decided[0]["buckets"] > 1
    for d in decided:  # the vote's values are not gradients: the norm the clip sees leaves them out
        assert d["squared_norm"] == pytest.approx(d["grads_squared"], rel=1e-6)
    assert decided[0]["grads_squared"] == decided[1]["grads_squared"]  # summed: the same on both


@pytest.mark.parametrize("layout, carries", [("parallel.dp=2", True), ("parallel.dp=1", True),
                                             ("parallel.pp=2", False)])
def test_only_a_purely_data_parallel_generation_carries_the_vote_in_its_gradients(make_config, layout, carries):
    cfg = make_config(layout)
    mesh = Mesh(dp=cfg.parallel.dp, pp=cfg.parallel.pp)
    layers = stage_layers(cfg, [list(range(cfg.model.gpt_layers))], 0, 0, torch.device("cpu"))
    threads = torch.get_num_threads()
    try:
        grads = layers.wrap(Groups(None, None), mesh, 0, torch.optim.SGD(layers.params, lr=0.1))
    finally:
        torch.set_num_threads(threads)
    assert grads.carries_vote is carries


def _one_step(spec, rank: int, mesh: Mesh, store, out_dir: str, infinite_on: int, leaving_on: int) -> None:
    """Step 0 of a Stage in this forked process, its loss inf on rank ``infinite_on`` and told to leave on
    rank ``leaving_on`` (-1: none); writes its report's verdict and how often the vote's own collective ran."""
    from raytrain.worker import vote
    from raytrain.worker.stage import Stage

    if rank == infinite_on:
        os.environ[INFINITE_LOSS_ENV] = "1"
    own_votes = []
    world_vote = vote.world_vote
    vote.world_vote = lambda *args: own_votes.append(1) or world_vote(*args)
    replica, stage_index = mesh.coords(rank)
    stage = Stage(spec, Slot(stage_index), leaving=lambda: rank == leaving_on)
    stage.join(rank, mesh, even_shares(spec.cfg.train.global_batch, mesh.dp), store, generation=0, faults=[])
    report = stage.run_step(0)
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump({"ok": report.ok, "nonfinite": report.nonfinite, "drain_after": report.drain_after,
                   "committed": report.committed, "own_votes": len(own_votes)}, f)
    stage.shutdown()


@pytest.mark.parametrize("layout, own_vote", [("parallel.dp=2", False), ("parallel.pp=2", True)])
@pytest.mark.parametrize("infinite_on, leaving_on", [(1, -1), (-1, 0), (-1, -1)])
def test_a_stages_vote_reaches_every_worker_whether_the_gradients_carry_it_or_not(
        tmp_path, layout, own_vote, infinite_on, leaving_on):
    """One worker's infinite loss (its gradients finite: only the vote can tell) stops the step on every
    worker, and one worker told to leave makes the step's end everyone's boundary: through the gradients in
    a purely data-parallel run (no vote collective of its own), through the world-wide vote otherwise."""
    cfg = load_config(None, ["model.factory=tests.factories:infinite_loss_here", "data.builtin=digits",
                             "train.global_batch=8", "train.steps=1", "train.grad_clip=0", f"run.dir={tmp_path}",
                             layout])
    prepared = prepare(cfg)
    mesh = prepared.layout.mesh
    rendezvous = RendezvousStore()
    store = rendezvous.address("127.0.0.1", namespace="stage-vote/")
    try:
        run_forked(_one_step, [(prepared.worker_spec(), rank, mesh, store, str(tmp_path), infinite_on, leaving_on)
                               for rank in range(2)])
    finally:
        rendezvous.close()
    reports = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]
    finite = infinite_on < 0
    assert [(r["ok"], r["nonfinite"], r["committed"]) for r in reports] == [(finite, not finite, int(finite))] * 2
    if finite:
        assert [r["drain_after"] for r in reports] == [leaving_on >= 0] * 2
    assert [r["own_votes"] for r in reports] == [int(own_vote)] * 2
