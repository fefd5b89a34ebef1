"""Recovery from a lost worker: raytrain repair in place vs Ray Train V2 elastic restart.

One worker process is SIGKILLed from outside once the run passes a fixed step, or sent SIGTERM (a
preemption notice: raytrain drains it at a step boundary, once a replacement started at the notice
is up, or at once with elastic.replace_at_notice=false); one raytrain run has a standby worker
(elastic.standby=1) to take the killed one's place. For raytrain (the dp=2 GPT of bench_dp,
and a dp=2 x pp=2 run) this reports detection time, repair time, seconds from the fault to the next
committed step, committed steps lost or redone, and the run's goodput (the share of its wall time in
committed steps, raytrain.control.goodput). Ray Train V2 runs the same dp=2 model with
ScalingConfig(num_workers=(1, 2)) and a checkpoint every 10 steps; on a failure it restarts its
worker group from the last checkpoint; its goodput is derived from its workers' step times (the
steps it kept) over the trainer process's wall time. For a drain, "fault -> commit" is the notice to
the next committed step; the row also says when the boundary where the worker left came, and the
first step without it committed.

    python experiments/bench_recovery.py              # the 30-step table, about 8 minutes on 2 cores
    python experiments/bench_recovery.py --only drain # some of its rows
    python experiments/bench_recovery.py --goodput    # 300-step runs: 0, 1 and 3 kills, a drain; both systems
    python experiments/bench_recovery.py --nodes      # a node lost, then another added: grow-back; both systems
    python experiments/bench_recovery.py --nodes --only raytrain --repeats 5   # raytrain's grow-back, 5 runs
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

MODEL = ["model.n_layer=4", "model.d_model=256", "model.n_head=4", "model.seq_len=128", "model.vocab_size=256"]
GLOBAL_BATCH = 32
KILL_STEP = 15
STEPS = 30


def config(extra, steps: int = STEPS):
    from raytrain.config import load_config

    return load_config(None, MODEL + [f"train.steps={steps}", f"train.global_batch={GLOBAL_BATCH}", "train.lr=1e-3",
                                      "run.trace_steps=0", "elastic.min_dp=1", *extra])


def stage_worker_pids() -> list[int]:
    """Pids of the processes hosting a raytrain StageWorker (this benchmark runs one Ray at a time)."""
    pids = []
    for pid in (int(d) for d in os.listdir("/proc") if d.isdigit()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().startswith(b"ray::StageWorker"):
                    pids.append(pid)
        except OSError:
            continue
    return pids


def raytrain_recovery(name: str, extra: list[str], workdir: str, sig: int = signal.SIGKILL,
                      fault_steps: tuple = (KILL_STEP,), steps: int = STEPS) -> dict:
    """One raytrain run; after each step of ``fault_steps`` a worker (the last rank's at first, then one
    that is not the first survivor) gets ``sig``. Figures of the first fault, and the run's goodput."""
    from raytrain import train

    state: dict = {"faults": []}

    def fault_after_step(rows):
        for row in rows:
            if row.get("event") == "started":
                state["pids"] = row["pids"]
            due = [s for s in fault_steps if s not in state["faults"] and row.get("step", 0) >= s and "loss" in row]
            if due:
                pid = state["pids"][-1] if not state["faults"] else max(
                    p for p in stage_worker_pids() if p != state["pids"][0])
                os.kill(pid, sig)
                state["faults"].append(due[0])
                state.setdefault("killed_at", time.time())
                state.setdefault("kill_step", row["step"])

    result = train(config(extra + [f"run.dir={workdir}"], steps), stream=open(os.devnull, "w"),
                   on_rows=fault_after_step)
    committed, goodput = result.committed_steps, result.goodput["goodput"]
    common = {"system": name, "kill_step": state.get("kill_step", "-"), "steps_lost": len(committed) - len(set(committed)),
              "grew_back": any(e["event"] == "grow" for e in result.events), "goodput": goodput,
              "faults": len(state["faults"])}
    if sig == signal.SIGCONT:  # a signal that changes nothing: the fault-free baseline
        return {**common, "detect_s": float("nan"), "repair_s": float("nan"), "kill_to_commit_s": float("nan"),
                "layout_after": "no fault"}
    if sig == signal.SIGTERM:  # drained: no failure to detect
        drain = next(e for e in result.events if e["event"] == "drain")
        next_commit = min(r["time"] for r in result.metrics if r["time"] > drain["noticed_at"])
        narrowest = min(r["dp"] for r in result.metrics)
        how = (f"replaced at the notice, narrowest dp={narrowest}" if drain["replaced_at_notice"]
               else f"{drain['new_layout']}")
        return {**common, "detect_s": 0.0, "repair_s": drain["reform_s"],
                "kill_to_commit_s": next_commit - drain["noticed_at"],
                "layout_after": f"{how}; first step without it {drain['notice_to_step_s']:.2f} s after the notice "
                                f"(boundary at {drain['notice_to_boundary_s']:.2f} s)"}
    repair = next(e for e in result.events if e["event"] == "repair")
    # the first step run after the repair (a step rolled forward commits during it, run before the fault)
    next_commit = min(r["time"] for r in result.metrics
                      if r.get("time", 0) > repair["detected_at"] and not r.get("rolled_forward"))
    return {**common, "detect_s": repair["detected_at"] - state["killed_at"], "repair_s": repair["repair_s"],
            "kill_to_commit_s": next_commit - state["killed_at"], "layout_after": repair["new_layout"]}


FAST_NODE_DEATH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500, "health_check_failure_threshold": 3}
"""Ray notices a lost node in about 1.5 s (its default is tens of seconds); as the test suite's cluster."""


def raytrain_node_lost_then_added(workdir: str, steps: int) -> dict:
    """dp=2 spread over two nodes of a ray.cluster_utils.Cluster: after KILL_STEP the second node is
    removed (its worker dies with it), the run shrinks; a second after it has, another node is added
    and the run grows back. Grow-back: the new node registered (``add_node`` returned) -> first step
    at dp=2."""
    import ray
    from ray.cluster_utils import Cluster

    from raytrain import train

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False,
                                                            "_system_config": FAST_NODE_DEATH})
    node = cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, log_to_driver=False)
    state: dict = {}

    def on_rows(rows):  # the driver's thread: Cluster's nodes are added from the main thread only
        for row in rows:
            if row.get("event") == "repair":
                state["shrunk_at"] = time.time()
            if row.get("step", 0) >= KILL_STEP and "loss" in row and "lost_at" not in state:
                cluster.remove_node(node, allow_graceful=False)
                state["lost_at"] = time.time()
        # the run trains at dp=1 a while before the capacity returns
        if "shrunk_at" in state and "added_at" not in state and time.time() > state["shrunk_at"] + 1.0:
            cluster.add_node(num_cpus=1)
            state["added_at"] = time.time()

    try:
        result = train(config(["parallel.dp=2", "elastic.max_dp=2", "elastic.grow_poll_s=0.5",
                               "resources.placement_strategy=STRICT_SPREAD", f"run.dir={workdir}"], steps),
                       stream=open(os.devnull, "w"), on_rows=on_rows)
    finally:
        ray.shutdown()
        cluster.shutdown()
    committed = result.committed_steps
    repair = next(e for e in result.events if e["event"] == "repair")
    grow = next(e for e in result.events if e["event"] == "grow" and e["new_layout"].startswith("dp=2"))
    back = min(r["time"] for r in result.metrics if r.get("dp") == 2 and r["time"] > state["added_at"])
    return {"system": "raytrain dp=2, node lost, then added", "kill_step": repair["step"], "faults": 1,
            "detect_s": repair["detected_at"] - state["lost_at"], "repair_s": repair["repair_s"],
            "kill_to_commit_s": min(r["time"] for r in result.metrics if r["time"] > repair["detected_at"])
            - state["lost_at"], "steps_lost": len(committed) - len(set(committed)), "grew_back": True,
            "goodput": result.goodput["goodput"], "grow_back_s": back - state["added_at"], "grow_s": grow["grow_s"],
            "layout_after": f"dp=1, then dp=2 {back - state['added_at']:.2f} s after the node was added "
                            f"(re-form {grow['grow_s']:.2f} s)"}


# --- Ray Train V2 --------------------------------------------------------------------------------


def ray_train_worker_loop(loop_config):
    import tempfile as tf

    import torch

    import ray.train
    import ray.train.torch as rtt
    from raytrain import data
    from raytrain.models.layers import build_model

    torch.set_num_threads(1)
    steps = loop_config["steps"]
    cfg = config([], steps)
    spec = build_model(cfg.model, cfg.train.seed)
    model = rtt.prepare_model(torch.nn.Sequential(*spec.layers))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    start = 0
    ckpt = ray.train.get_checkpoint()
    if ckpt:
        with ckpt.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), weights_only=True)
            unwrapped(model).load_state_dict(state["model"])
            opt.load_state_dict(state["optim"])
            start = state["step"]
    ds = data.TokenDataset(data.resolve_data_path(cfg), "tokens", cfg.model.seq_len)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    log = open(loop_config["progress"], "a")
    log.write(json.dumps({"event": "start", "rank": rank, "world": world, "pid": os.getpid(), "step": start,
                          "time": time.time()}) + "\n")
    log.flush()
    share = GLOBAL_BATCH // world
    for step in range(start, steps):
        x, y = ds.batch(data.sample_ids(0, len(ds), step * GLOBAL_BATCH + rank * share, step * GLOBAL_BATCH + (rank + 1) * share))
        opt.zero_grad()
        loss = spec.loss_fn(model(x), y)
        loss.backward()
        opt.step()
        checkpoint = None
        if (step + 1) % 10 == 0 and rank == 0:
            d = tf.mkdtemp()
            torch.save({"model": unwrapped(model).state_dict(), "optim": opt.state_dict(), "step": step + 1},
                       os.path.join(d, "state.pt"))
            checkpoint = ray.train.Checkpoint.from_directory(d)
        ray.train.report({"loss": loss.item(), "step": step + 1}, checkpoint=checkpoint)
        log.write(json.dumps({"event": "step", "rank": rank, "pid": os.getpid(), "step": step + 1, "time": time.time()}) + "\n")
        log.flush()


def unwrapped(model):
    """The model inside Ray Train's DDP wrapper; a one-worker group's model is not wrapped (until this
    was seen, every restart of the node run at one worker failed on ``model.module``)."""
    return getattr(model, "module", model)


def run_ray_train(workdir: str, progress: str, steps: int, address: Optional[str] = None) -> None:
    """Ray Train V2's run (a subprocess of the benchmark): on an embedded Ray, or with ``address`` on
    the benchmark's Cluster, one worker per node."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    TorchTrainer(
        ray_train_worker_loop, train_loop_config={"progress": progress, "steps": steps},
        scaling_config=ScalingConfig(num_workers=(1, 2), use_gpu=False,
                                     resources_per_worker={"CPU": 1, TRAINER_SLOT: 1} if address else {"CPU": 1},
                                     placement_strategy="STRICT_SPREAD" if address else "PACK"),
        run_config=RunConfig(storage_path=workdir, name=os.path.splitext(os.path.basename(progress))[0],
                             failure_config=FailureConfig(max_failures=3)),
    ).fit()
    ray.shutdown()


def ray_train_recovery(workdir: str, sig: int = signal.SIGKILL, fault_steps: tuple = (KILL_STEP,),
                       steps: int = STEPS) -> dict:
    """Ray Train V2 under the same faults: after each step of ``fault_steps`` the highest rank's worker
    gets ``sig`` (SIGCONT: none, the fault-free run)."""
    progress = os.path.join(workdir, f"progress-{sig}-{len(fault_steps)}-{steps}.jsonl")
    launched = time.time()
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--ray-train", workdir, "--progress", progress,
                             "--steps", str(steps)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    faults: list[tuple[float, int]] = []  # (time, step) of each fault sent
    deadline = time.monotonic() + 1800
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
        if sig != signal.SIGCONT and len(faults) < len(fault_steps) and os.path.exists(progress):
            lines = [json.loads(l) for l in open(progress).read().splitlines() if l.strip()]
            done = [l for l in lines if l["event"] == "step" and l["time"] > (faults[-1][0] if faults else 0)]
            if done and done[-1]["step"] >= fault_steps[len(faults)]:
                last = max(done, key=lambda l: (l["rank"], l["time"]))
                os.kill(last["pid"], sig)
                faults.append((time.time(), last["step"]))
    proc.wait(timeout=60)
    ended = time.time()
    lines = [json.loads(l) for l in open(progress).read().splitlines() if l.strip()]
    name = f"Ray Train V2 (1..2 workers), {steps} steps"
    goodput = ray_train_goodput(lines, ended - launched)
    if not faults:
        return {"system": name, "kill_step": "-", "faults": 0, "detect_s": float("nan"), "repair_s": float("nan"),
                "kill_to_commit_s": float("nan"), "steps_lost": 0, "layout_after": "no fault", "grew_back": None,
                "goodput": goodput}
    killed_at, kill_step = faults[0]
    restart = min(l["time"] for l in lines if l["event"] == "start" and l["time"] > killed_at)
    redone = 0
    for at, step in faults:
        resumed = next(l["step"] for l in sorted(lines, key=lambda l: l["time"]) if l["event"] == "start" and l["time"] > at)
        redone += step - resumed
    next_commit = min(l["time"] for l in lines if l["event"] == "step" and l["time"] > killed_at)
    return {"system": name, "kill_step": kill_step, "faults": len(faults), "detect_s": float("nan"),
            "repair_s": restart - killed_at, "kill_to_commit_s": next_commit - killed_at,
            "steps_lost": redone, "layout_after": "restart from checkpoint", "grew_back": None, "goodput": goodput}


def ray_train_node_lost_then_added(workdir: str, steps: int) -> dict:
    """Ray Train V2 under raytrain_node_lost_then_added's faults: its two workers on two nodes of a
    Cluster, the second node removed after KILL_STEP, another added a second after the group restarted.
    Grow-back: the node added -> the first step of a two-worker group.

    Every node has one TRAINER_SLOT, which each worker also asks for: Ray Train's elastic policy sizes
    a new group by the resources each node has, not by the placement strategy, so without it the
    head's two CPUs count as room for two workers, the STRICT_SPREAD group of two it then asks for
    cannot be placed on one node, and the run never restarts (what this benchmark measured before)."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False,
                                                            "resources": {TRAINER_SLOT: 1},
                                                            "_system_config": FAST_NODE_DEATH})
    node = cluster.add_node(num_cpus=1, resources={TRAINER_SLOT: 1})
    progress = os.path.join(workdir, f"progress-nodes-{steps}.jsonl")
    launched, state = time.time(), {}
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--ray-train", workdir, "--progress", progress,
                             "--steps", str(steps), "--address", cluster.address],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 1800
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
            lines = [json.loads(l) for l in open(progress).read().splitlines() if l.strip()] \
                if os.path.exists(progress) else []
            if "lost_at" not in state and any(l["event"] == "step" and l["step"] >= KILL_STEP for l in lines):
                cluster.remove_node(node, allow_graceful=False)
                state["lost_at"] = time.time()
            restarts = [l for l in lines if l["event"] == "start" and l["time"] > state.get("lost_at", float("inf"))]
            if not restarts and time.time() > state.get("lost_at", float("inf")) + RESTART_WAIT_S:
                break  # it did not come back (seen once: its group hung on the lost node's worker)
            if restarts and "added_at" not in state and time.time() > restarts[0]["time"] + 1.0:
                cluster.add_node(num_cpus=1, resources={TRAINER_SLOT: 1})
                state["added_at"] = time.time()
        if proc.poll() is None and "added_at" in state:
            proc.wait(timeout=600)
        ended = time.time()
    finally:
        proc.kill()
        cluster.shutdown()
    lines = [json.loads(l) for l in open(progress).read().splitlines() if l.strip()]
    ordered = sorted(lines, key=lambda l: l["time"])
    if "added_at" not in state:
        return {"system": "Ray Train V2, node lost, then added", "kill_step": KILL_STEP, "faults": 1,
                "detect_s": float("nan"), "repair_s": float("nan"), "kill_to_commit_s": float("nan"),
                "steps_lost": 0, "grew_back": None, "goodput": ray_train_goodput(lines, ended - launched),
                "layout_after": f"no restart within {RESTART_WAIT_S:.0f} s of the node's loss: stopped"}
    lost_at, added_at = state["lost_at"], state["added_at"]
    restart = next(l for l in ordered if l["event"] == "start" and l["time"] > lost_at)
    wide = next(l for l in ordered if l["event"] == "start" and l["world"] == 2 and l["time"] > added_at)
    back = next(l["time"] for l in ordered if l["event"] == "step" and l["time"] > wide["time"])
    last_before = max(l["step"] for l in ordered if l["event"] == "step" and l["time"] < lost_at)
    redone = (last_before - restart["step"]) + (max(l["step"] for l in ordered if l["event"] == "step"
                                                     and l["time"] < wide["time"]) - wide["step"])
    return {"system": "Ray Train V2, node lost, then added", "kill_step": last_before, "faults": 1,
            "detect_s": float("nan"), "repair_s": restart["time"] - lost_at,
            "kill_to_commit_s": next(l["time"] for l in ordered if l["event"] == "step" and l["time"] > lost_at)
            - lost_at, "steps_lost": redone, "grew_back": None, "goodput": ray_train_goodput(lines, ended - launched),
            "layout_after": f"1 worker, then 2 {back - added_at:.2f} s after the node was added (a restart from "
                            "its checkpoint)"}


def ray_train_goodput(lines: list[dict], wall_s: float) -> float:
    """Rank 0's time in the steps the run kept (each step's last run, timed from the step before it in
    the same worker group) over the trainer process's wall time."""
    kept, last = {}, None
    for line in sorted((l for l in lines if l["rank"] == 0), key=lambda l: l["time"]):
        if line["event"] == "start":
            last = line["time"]  # a (re)started group's first step starts here
        elif last is not None:
            kept[line["step"]] = line["time"] - last
            last = line["time"]
    return sum(kept.values()) / wall_s


LONG_STEPS = 300
"""The goodput runs' length (--goodput): one kill at step 150, three at 75, 150 and 225, a drain at 150."""


RESTART_WAIT_S = 300.0
"""How long Ray Train's run may take to restart after its node is lost before the benchmark gives up on it."""
TRAINER_SLOT = "trainer_slot"
"""A custom resource, one per node of Ray Train's node run (ray_train_node_lost_then_added says why)."""
NODE_STEPS = 200
"""Both systems' node runs: long enough for Ray Train to grow back, which it does only at its resize
check (every 60 s), so that their goodputs compare."""


def short_runs(workdir: str, only: set) -> None:
    """The 30-step table: one fault each, every system."""
    import ray

    print(f"SIGKILL (or SIGTERM) of one worker after step {KILL_STEP} of {STEPS} (GPT 4x256, global batch "
          f"{GLOBAL_BATCH}); goodput: committed-step time over wall time from the launch")
    header()
    runs = {
        "shrink": lambda: raytrain_recovery("raytrain dp=2", ["parallel.dp=2"], workdir),
        "replace": lambda: raytrain_recovery("raytrain dp=2 (replace)", ["parallel.dp=2", "elastic.min_dp=2"], workdir),
        "standby": lambda: raytrain_recovery("raytrain dp=2 (standby)",
                                             ["parallel.dp=2", "elastic.min_dp=2", "elastic.standby=1"], workdir),
        "pp": lambda: raytrain_recovery("raytrain dp=2 x pp=2",
                                        ["parallel.dp=2", "parallel.pp=2", "parallel.microbatches=2"], workdir),
        "drain": lambda: raytrain_recovery("raytrain dp=2 SIGTERM (drain)",
                                           ["parallel.dp=2", "elastic.replace_at_notice=false"], workdir, signal.SIGTERM),
        "drain-replace": lambda: raytrain_recovery("raytrain dp=2 SIGTERM (replaced)", ["parallel.dp=2"], workdir,
                                                   signal.SIGTERM),
        "fault-free": lambda: raytrain_recovery("raytrain dp=2 fault-free", ["parallel.dp=2"], workdir, signal.SIGCONT),
    }
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    for name, run in runs.items():
        if not only or name in only:
            show(run())
    ray.shutdown()
    if not only or "ray-train" in only:
        show(ray_train_recovery(workdir))
        show(ray_train_recovery(workdir, signal.SIGTERM))


def goodput_runs(workdir: str) -> None:
    """300-step runs, fault-free and under the same faults for both systems; goodput against fault-free."""
    import ray

    print(f"{LONG_STEPS}-step runs (GPT 4x256, global batch {GLOBAL_BATCH}, dp=2, elastic.min_dp=1): goodput "
          "against the same system's fault-free run")
    header()
    one, three = (150,), (75, 150, 225)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    base = show(raytrain_recovery("raytrain fault-free", ["parallel.dp=2"], workdir, signal.SIGCONT, steps=LONG_STEPS))
    for name, sig, faults, extra in (("raytrain 1 kill", signal.SIGKILL, one, []),
                                     ("raytrain 3 kills", signal.SIGKILL, three, []),
                                     ("raytrain 1 drain", signal.SIGTERM, one, ["elastic.replace_at_notice=false"]),
                                     ("raytrain 1 drain (replaced)", signal.SIGTERM, one, [])):
        show(raytrain_recovery(name, ["parallel.dp=2", *extra], workdir, sig, faults, LONG_STEPS), base)
    ray.shutdown()
    base = show(ray_train_recovery(workdir, signal.SIGCONT, (), LONG_STEPS))
    show(ray_train_recovery(workdir, signal.SIGKILL, one, LONG_STEPS), base)
    show(ray_train_recovery(workdir, signal.SIGKILL, three, LONG_STEPS), base)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated rows of the 30-step table: shrink, replace, "
                        "standby, pp, drain, drain-replace, fault-free, ray-train (default: all); with --nodes: "
                        "raytrain or ray-train")
    parser.add_argument("--repeats", type=int, default=1, help="with --nodes: raytrain's runs (default 1)")
    parser.add_argument("--goodput", action="store_true", help=f"the {LONG_STEPS}-step goodput runs instead")
    parser.add_argument("--nodes", action="store_true", help="a node lost, then another added (grow-back) instead")
    parser.add_argument("--ray-train", metavar="WORKDIR", help=argparse.SUPPRESS)
    parser.add_argument("--progress", metavar="FILE", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=STEPS, help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.nodes and args.only not in ("", "raytrain", "ray-train"):
        parser.error(f"--only {args.only} with --nodes: give --only raytrain or --only ray-train (that system's "
                     "runs alone), or no --only")
    if args.repeats < 1 or (args.repeats > 1 and not args.nodes):
        parser.error(f"--repeats {args.repeats}: give a count >= 1, with --nodes (the other tables run once)")
    if args.ray_train:
        run_ray_train(args.ray_train, args.progress, args.steps, args.address)
        return
    from raytrain import data

    data.resolve_data_path(config([]))
    with tempfile.TemporaryDirectory() as workdir:
        if args.goodput:
            goodput_runs(workdir)
        elif args.nodes:
            node_runs(workdir, args.repeats, systems={args.only} if args.only else {"raytrain", "ray-train"})
        else:
            short_runs(workdir, {n for n in args.only.split(",") if n})


def node_runs(workdir: str, repeats: int, systems: set) -> None:
    """A node lost, then another added: raytrain ``repeats`` times (the median grow-back printed after
    more than one), then Ray Train V2 once; ``systems`` says which of the two run."""
    header()
    grow_backs = [show(raytrain_node_lost_then_added(workdir, NODE_STEPS))["grow_back_s"]
                  for _ in range(repeats if "raytrain" in systems else 0)]
    if len(grow_backs) > 1:
        print(f"raytrain grow-back, node added -> first step at dp=2: median {statistics.median(grow_backs):.2f} s, "
              f"max {max(grow_backs):.2f} s, runs {' '.join(f'{g:.2f}' for g in grow_backs)}", flush=True)
    if "ray-train" in systems:
        show(ray_train_node_lost_then_added(workdir, NODE_STEPS))


def header() -> None:
    print(f"{'system':<40} {'fault at':>8} {'detect s':>8} {'repair s':>8} {'fault->commit s':>15} "
          f"{'steps redone':>12} {'goodput':>7}  after", flush=True)


def show(r: dict, baseline: Optional[dict] = None) -> dict:
    """Print one row (with ``baseline``: its goodput as a ratio of that fault-free run's); returns it."""
    ratio = f" ({r['goodput'] / baseline['goodput']:.3f}x fault-free)" if baseline else ""
    print(f"{r['system']:<40} {r['kill_step']:>8} {r['detect_s']:>8.2f} {r['repair_s']:>8.2f} "
          f"{r['kill_to_commit_s']:>15.2f} {r['steps_lost']:>12} {r['goodput']:>7.3f}{ratio}  {r['layout_after']}"
          + ("" if r["grew_back"] is None else f" (grew back: {r['grew_back']})"), flush=True)
    return r


if __name__ == "__main__":
    main()
