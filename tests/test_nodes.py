"""Nodes leave and join the session's cluster (ray.cluster_utils.Cluster): the run repairs, waits a
bounded time for capacity or grows back when a node is added, with the same math throughout.

The workers are spread one per node (resources.placement_strategy=STRICT_SPREAD) over the head and
an added node, so removing that node kills exactly one worker, as losing a machine does.
"""

import os
import signal
import time

import pytest

from raytrain import checkpoint, data, train
from raytrain.api import prepare
from raytrain.control.coordinator import CapacityLost
from tests.helpers import (LONG_RUN_LR, TEST_RAY_CPUS, WhenPaused, assert_replicas_identical, assert_same_params,
                           hold_at_the_notice_until_its_replacement_starts, hold_until_a_new_worker_starts, pid_alive,
                           reference_state, stage_worker_pids)


@pytest.fixture
def add_node(ray_cluster):
    """Adds one-CPU nodes for the duration of a test; every node a test added is removed afterwards."""
    before = set(ray_cluster.worker_nodes)
    yield lambda: ray_cluster.add_node(num_cpus=1)
    for node in set(ray_cluster.worker_nodes) - before:
        ray_cluster.remove_node(node, allow_graceful=False)


@pytest.fixture
def worker_node(add_node):
    return add_node()


@pytest.fixture
def two_nodes_of_two_cpus(ray_cluster):
    """Two 2-CPU nodes the run has to itself: another job holds every CPU of the head first."""
    from ray.util.placement_group import placement_group, remove_placement_group

    head = placement_group([{"CPU": float(TEST_RAY_CPUS)}])  # before the nodes exist: it lands on the head
    assert head.wait(timeout_seconds=30)
    nodes = [ray_cluster.add_node(num_cpus=2) for _ in range(2)]
    ray_cluster.wait_for_nodes()
    yield nodes
    remove_placement_group(head)
    for node in nodes:
        if node in ray_cluster.worker_nodes:
            ray_cluster.remove_node(node, allow_graceful=False)


def _tp_groups_share_a_node(started: dict) -> dict[str, str]:
    """From the run's started event: the node of each tp group (``replica r shard f stage s``), asserting that both
    of its tp ranks run there."""
    nodes: dict[str, set] = {}
    for place, node in started["placement"].items():
        nodes.setdefault(place.rsplit(" tp ", 1)[0], set()).add(node)
    assert all(len(n) == 1 for n in nodes.values()), started["placement"]
    return {group: next(iter(n)) for group, n in nodes.items()}


def test_dp2_tp2_over_two_nodes_keeps_each_tp_group_on_one_and_a_lost_node_takes_only_its_replica(
        ray_cluster, two_nodes_of_two_cpus, make_config, fast_driver_poll):
    # Each replica is one tp group, packed on a node of its own (the nodes hold two workers each); no
    # placement setting asks for it. The node that goes takes its replica: dp=1 finishes on the other.
    cfg = make_config("parallel.dp=2", "parallel.tp=2", "elastic.min_dp=1", "train.steps=30", LONG_RUN_LR,
                      "run.record_samples=true", "elastic.capacity_wait_s=5")
    lost = []

    def on_rows(rows):
        if not lost and any(r.get("step", 0) >= 3 and "loss" in r for r in rows):
            ray_cluster.remove_node(two_nodes_of_two_cpus[1], allow_graceful=False)
            lost.append(True)

    result = train(cfg, on_rows=on_rows)
    placed = _tp_groups_share_a_node(next(e for e in result.events if e["event"] == "started"))
    assert placed["replica 0 shard 0 stage 0"] != placed["replica 1 shard 0 stage 0"], placed
    on_lost_node = [group for group, node in placed.items() if node == two_nodes_of_two_cpus[1].node_id]
    assert len(on_lost_node) == 1, placed
    repairs = [e for e in result.events if e["event"] == "repair"]
    assert lost and repairs[0]["new_layout"] == "dp=1 tp=2 pp=1", repairs  # the whole replica went with its node
    # The node's two workers die moments apart, so one repair or two may name them; every place lost is
    # on the replica that lived on the node, and the other replica never loses a worker.
    replica = on_lost_node[0].split(" shard ")[0]
    places_lost = [place for repair in repairs for place in repair["lost"]]
    assert places_lost and all(place.startswith(f"{replica} ") for place in places_lost), repairs
    assert result.committed_steps == list(range(30))
    ids = [i for r in result.metrics for i in r["sample_ids"]]
    assert len(ids) == len(set(ids)) == 30 * 8  # each sample once
    assert_same_params(checkpoint.load_state_dict(result.checkpoint), reference_state(cfg))


def test_tp2_pp2_over_two_nodes_keeps_each_stages_tp_group_on_one_and_equals_one_process(
        ray_cluster, two_nodes_of_two_cpus, make_config):
    cfg = make_config("parallel.tp=2", "parallel.pp=2", "parallel.microbatches=2", "train.steps=4")
    result = train(cfg)
    placed = _tp_groups_share_a_node(next(e for e in result.events if e["event"] == "started"))
    assert placed["replica 0 shard 0 stage 0"] != placed["replica 0 shard 0 stage 1"], placed  # two workers per node
    assert_same_params(checkpoint.load_state_dict(result.checkpoint), reference_state(cfg))


def test_node_lost_then_added_grows_back_to_max_dp(ray_cluster, worker_node, make_config, fast_driver_poll):
    steps = 300
    cfg = make_config("parallel.dp=2", "elastic.min_dp=1", "elastic.max_dp=2", f"train.steps={steps}", LONG_RUN_LR,
                      "resources.placement_strategy=STRICT_SPREAD", "run.record_samples=true", "run.trace_steps=0",
                      "elastic.grow_poll_s=0.5")
    replaced, seen = [], {}

    def on_rows(rows):
        for row in rows:
            if row.get("event") == "started":
                seen["survivor"], seen["known"] = row["pids"][0], stage_worker_pids()
            if row.get("event") == "repair" and "new" not in seen:
                seen["new"] = hold_until_a_new_worker_starts([seen["survivor"]], seen["known"])
        if not replaced and any(r.get("step", 0) >= 5 and "loss" in r for r in rows):
            ray_cluster.remove_node(worker_node, allow_graceful=False)  # the machine goes away...
            replaced.append(ray_cluster.add_node(num_cpus=1))  # ...and another joins

    result = train(cfg, on_rows=on_rows)
    events = [e["event"] for e in result.events]
    assert replaced, "the node was never removed"
    repair = next(e for e in result.events if e["event"] == "repair")
    assert repair["new_layout"] == "dp=1 pp=1" and repair["lost"] == ["replica 1 stage 0"]
    grows = [e for e in result.events if e["event"] == "grow"]
    assert len(grows) == 1 and grows[0]["new_layout"] == "dp=2 pp=1", events
    print(f"repaired at step {repair['step']}, grew back at step {grows[0]['step']} of {steps}")
    layouts = [r["layout"] for r in result.metrics]
    assert "dp=1 pp=1" in layouts and layouts[-1] == "dp=2 pp=1"
    assert result.worker_pids[0] in result.final_pids, "the survivor on the head node was restarted"
    assert seen["new"] in result.final_pids
    assert result.committed_steps == list(range(steps))
    # Every global position consumed once, in the fault-free order, across both resizes.
    num_samples = prepare(cfg).num_samples
    ids = [i for r in result.metrics for i in r["sample_ids"]]
    assert ids == data.sample_ids(cfg.train.seed, num_samples, 0, steps * cfg.train.global_batch)
    assert_replicas_identical(result, replicas=2)
    assert_same_params(checkpoint.load_state_dict(result.checkpoint), reference_state(cfg))


def test_capacity_below_min_dp_waits_then_fails_with_checkpoint_intact(ray_cluster, worker_node, make_config,
                                                                      tmp_path):
    # min_dp defaults to dp=2: losing the node leaves one replica and nowhere to start a second.
    # Both replicas pause at the start of step 10, the node goes while they are held, and only then
    # does the survivor go on: the run ends at a known step (10 committed), whatever the timing.
    cfg = make_config("parallel.dp=2", f"checkpoint.dir={tmp_path / 'ckpt'}", "train.steps=100000", "checkpoint.every=4",
                      "elastic.capacity_wait_s=4", "resources.placement_strategy=STRICT_SPREAD", "run.trace_steps=0",
                      'elastic.faults=["0:0@10:pause","1:0@10:pause"]')
    seen = {"removed_at": None}

    def remove_the_node_then_resume_the_survivor(paused, started):
        ray_cluster.remove_node(worker_node, allow_graceful=False)
        seen["removed_at"] = time.time()
        deadline = time.monotonic() + 20  # the removed node's worker dies with its raylet
        while all(pid_alive(p) for p in paused) and time.monotonic() < deadline:
            time.sleep(0.05)
        for pid in paused:
            if pid_alive(pid):
                os.kill(pid, signal.SIGCONT)

    with WhenPaused(2, remove_the_node_then_resume_the_survivor, after_step=9) as watcher:
        with pytest.raises(CapacityLost) as err:
            train(cfg, on_rows=watcher.on_rows)
    assert watcher.acted and seen["removed_at"] is not None
    waited = time.time() - seen["removed_at"]
    message = str(err.value)
    assert "elastic.min_dp=2" in message and "elastic.capacity_wait_s=4" in message, message
    assert 4 <= waited < 40, f"failed {waited:.1f}s after the node was lost; elastic.capacity_wait_s=4 bounds the wait"
    latest = checkpoint.latest(cfg.checkpoint.dir)
    assert latest is not None and latest in message
    # The surviving replica saved the step the run reached (10), not only the last periodic save (8).
    assert checkpoint.read_manifest(latest)["step"] == 10
    assert_same_params(checkpoint.load_state_dict(latest), reference_state(cfg, steps=10))


def test_hybrid_losing_a_node_without_spare_capacity_carries_on_with_dp1(ray_cluster, add_node, make_config,
                                                                      fast_driver_poll):
    # Another job holds one of the head's 4 CPUs, so the dp=2 x pp=2 run puts three workers on the
    # head and the fourth on a one-CPU node. When that node goes, nothing can host a replacement:
    # the broken replica is dropped, its surviving worker waits as a spare, and dp=1 finishes the run.
    from ray.util.placement_group import placement_group, remove_placement_group

    other_job = placement_group([{"CPU": 1}])  # before the node exists: it lands on the head
    assert other_job.wait(timeout_seconds=30)
    node = add_node()
    cfg = make_config("parallel.dp=2", "parallel.pp=2", "parallel.microbatches=2", "elastic.min_dp=1",
                      "train.steps=150", LONG_RUN_LR, "run.trace_steps=0", "run.record_samples=true")
    removed = []

    def on_rows(rows):
        if not removed and any(r.get("step", 0) >= 3 and "loss" in r for r in rows):
            ray_cluster.remove_node(node, allow_graceful=False)
            removed.append(True)

    try:
        result = train(cfg, on_rows=on_rows)
    finally:
        remove_placement_group(other_job)
    events = [e["event"] for e in result.events]
    assert removed and result.failures == 1 and "grow" not in events and "reload" not in events, events
    repair = next(e for e in result.events if e["event"] == "repair")
    assert repair["new_layout"] == "dp=1 pp=2" and repair["pending_replacements"] == 1, repair
    assert [r["layout"] for r in result.metrics][-1] == "dp=1 pp=2"
    assert len(result.final_pids) == 2 and set(result.final_pids) <= set(result.worker_pids), "a survivor was restarted"
    assert result.committed_steps == list(range(150))
    assert_replicas_identical(result, replicas=1)
    assert_same_params(checkpoint.load_state_dict(result.checkpoint), reference_state(cfg))


def test_a_machine_without_the_builtin_corpus_gets_the_drivers_copy(ray_session, tmp_path):
    # The driver builds the built-in corpus in its own cache; a worker on another machine finds no
    # file at that path and writes the driver's bytes (from the object store) into its own cache.
    from raytrain.data.samples import DataSource, SampleSpec
    from raytrain.data.shards import one_file
    from raytrain.worker.actor import dataset_here

    drivers = tmp_path / "driver-cache" / "stdlib-bytes-fsb-T17-abc.parquet"
    drivers.parent.mkdir()
    drivers.write_bytes(b"PAR1 the driver's corpus PAR1")
    corpus = [ray_session.put(drivers.read_bytes())]
    elsewhere = DataSource(one_file(str(tmp_path / "not-on-this-machine" / drivers.name), 100), SampleSpec.tokens(16))
    node_cache = tmp_path / "node-cache"
    got = dataset_here(elsewhere, corpus, str(node_cache))
    assert got.train == one_file(str(node_cache / drivers.name), 100)  # the same samples, from this machine's copy
    assert open(got.train.paths[0], "rb").read() == drivers.read_bytes()
    assert os.listdir(node_cache) == [drivers.name]  # no temporary left behind
    here = DataSource(one_file(str(drivers), 100), SampleSpec.tokens(16))
    assert dataset_here(here, corpus, str(node_cache)) == here  # present here: used as is
    assert dataset_here(elsewhere, None, str(node_cache)) == elsewhere  # the user's data.path: never replaced


def drain_node(node, deadline_s: float = 30.0) -> None:
    """Drain ``node`` as Ray does on a cloud's preemption notice (the GCS call behind ``ray drain-node``:
    Ray 2.60 has no public API for it)."""
    import ray
    from ray.core.generated import autoscaler_pb2

    gcs = ray._raylet.GcsClient(address=ray.get_runtime_context().gcs_address)
    reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
    accepted, why = gcs.drain_node(node.node_id, reason, "a test's preemption", int((time.time() + deadline_s) * 1000))
    assert accepted, why


def test_the_worker_on_a_draining_node_trains_until_its_replacement_is_up(ray_cluster, worker_node, make_config,
                                                                          fast_driver_poll):
    # replica 1 runs on the added node (SPREAD; STRICT_SPREAD would not replace at the notice); Ray is told
    # to drain it (a preemption with a 60 s deadline): the worker sees it after a step and trains on while
    # a replacement starts on the head (Ray places nothing new on a draining node); once it is up the
    # worker goes at a boundary and the replacement takes its place: the run never narrows, nothing redone
    from raytrain.compat import draining_nodes

    steps = 300  # seconds of steps: a worker asks Ray about its node every second
    cfg = make_config("parallel.dp=2", "elastic.min_dp=1", f"train.steps={steps}", LONG_RUN_LR, "run.trace_steps=0",
                      "resources.placement_strategy=SPREAD", "run.record_samples=true")
    drained, seen = [], {}
    hold = hold_at_the_notice_until_its_replacement_starts(seen)

    def on_rows(rows):
        hold(rows)
        if not drained and any(r.get("step", 0) >= 3 and "loss" in r for r in rows):
            drain_node(worker_node, deadline_s=60)
            drained.append(draining_nodes())

    result = train(cfg, on_rows=on_rows)
    assert drained and worker_node.node_id in drained[0]  # raytrain.compat reads Ray's draining nodes
    assert seen["new"] in result.final_pids
    (event,) = [e for e in result.events if e["event"] == "drain"]
    assert event["why"] == ["node drain"] and len(event["workers"]) == 1, event  # the replica SPREAD put there
    assert 50 < event["deadline_s"] <= 60 and event["new_layout"] == "dp=2 pp=1" and event["replaced_at_notice"] == 1
    assert {r["dp"] for r in result.metrics} == {2}
    assert not [e for e in result.events if e["event"] in ("repair", "reload")] and result.failures == 0
    assert len(set(result.worker_pids) & set(result.final_pids)) == 1  # the survivor on the head kept its process
    assert result.committed_steps == list(range(steps))
    ids = [i for r in result.metrics for i in r["sample_ids"]]
    assert ids == data.sample_ids(cfg.train.seed, prepare(cfg).num_samples, 0, steps * cfg.train.global_batch)
    assert_same_params(checkpoint.load_state_dict(result.checkpoint), reference_state(cfg))


def test_a_draining_node_takes_its_pipeline_worker_and_the_rest_of_its_replica_waits(ray_cluster, add_node,
                                                                                    make_config, fast_driver_poll):
    # dp=2 x pp=2 with one of replica 1's stages on an added node (another job holds a head CPU, as in
    # the hybrid loss above). Ray drains that node: its worker leaves at a step boundary, its replica's
    # other stage waits as a spare, and dp=1 x pp=2 finishes with nothing redone or restarted.
    from ray.util.placement_group import placement_group, remove_placement_group

    other_job = placement_group([{"CPU": 1}])
    assert other_job.wait(timeout_seconds=30)
    node = add_node()
    steps = 150
    cfg = make_config("parallel.dp=2", "parallel.pp=2", "parallel.microbatches=2", "elastic.min_dp=1",
                      f"train.steps={steps}", LONG_RUN_LR, "run.trace_steps=0", "run.record_samples=true",
                      "elastic.replace_at_notice=false")  # no room for a replacement: it would wait out the deadline
    drained = []

    def on_rows(rows):
        if not drained and any(r.get("step", 0) >= 3 and "loss" in r for r in rows):
            drain_node(node, deadline_s=60)
            drained.append(True)

    try:
        result = train(cfg, on_rows=on_rows)
    finally:
        remove_placement_group(other_job)
    (event,) = [e for e in result.events if e["event"] == "drain"]
    assert drained and event["why"] == ["node drain"] and event["new_layout"] == "dp=1 pp=2", event
    assert len(event["workers"]) == 1 and event["workers"][0].startswith("replica 1"), event
    assert not [e for e in result.events if e["event"] in ("repair", "reload")] and result.failures == 0
    assert len(result.final_pids) == 2 and set(result.final_pids) <= set(result.worker_pids), "a survivor was restarted"
    assert result.committed_steps == list(range(steps))
    ids = [i for r in result.metrics for i in r["sample_ids"]]
    assert ids == data.sample_ids(cfg.train.seed, prepare(cfg).num_samples, 0, steps * cfg.train.global_batch)
    assert_same_params(checkpoint.load_state_dict(result.checkpoint), reference_state(cfg))
