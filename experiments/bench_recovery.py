"""Recovery from a lost worker: raytrain repair in place vs Ray Train V2 elastic restart.

One worker process is SIGKILLed from outside once the run passes a fixed step, or sent SIGTERM (a
preemption notice: raytrain drains it at a step boundary); one raytrain run has a standby worker
(elastic.standby=1) to take the killed one's place. For raytrain (the dp=2 GPT of bench_dp,
and a dp=2 x pp=2 run) this reports detection time, repair time, seconds from the fault to the next
committed step, committed steps lost or redone, and the run's goodput (the share of its wall time in
committed steps, raytrain.control.goodput). Ray Train V2 runs the same dp=2 model with
ScalingConfig(num_workers=(1, 2)) and a checkpoint every 10 steps; on a failure it restarts its
worker group from the last checkpoint; its goodput is derived from its workers' step times (the
steps it kept) over the trainer process's wall time.

    python experiments/bench_recovery.py            # about 5 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

MODEL = ["model.n_layer=4", "model.d_model=256", "model.n_head=4", "model.seq_len=128", "model.vocab_size=256"]
GLOBAL_BATCH = 32
KILL_STEP = 15
STEPS = 30


def config(extra):
    from raytrain.config import load_config

    return load_config(None, MODEL + [f"train.steps={STEPS}", f"train.global_batch={GLOBAL_BATCH}", "train.lr=1e-3",
                                      "run.trace_steps=0", "elastic.min_dp=1", *extra])


def raytrain_recovery(name: str, extra: list[str], workdir: str, sig: int = signal.SIGKILL) -> dict:
    from raytrain import train

    state: dict = {}

    def fault_after_step(rows):
        for row in rows:
            if row.get("event") == "started":
                state["pids"] = row["pids"]
            if row.get("step", 0) >= KILL_STEP and "killed_at" not in state:
                os.kill(state["pids"][-1], sig)  # the last rank: replica dp-1, last stage
                state["killed_at"], state["kill_step"] = time.time(), row["step"]

    result = train(config(extra + [f"run.dir={workdir}"]), stream=open(os.devnull, "w"), on_rows=fault_after_step)
    steps, goodput = result.committed_steps, result.goodput["goodput"]
    common = {"system": name, "kill_step": state["kill_step"], "steps_lost": len(steps) - len(set(steps)),
              "grew_back": any(e["event"] == "grow" for e in result.events), "goodput": goodput}
    if sig == signal.SIGCONT:  # a signal that changes nothing: the fault-free baseline
        return {**common, "detect_s": float("nan"), "repair_s": float("nan"), "kill_to_commit_s": float("nan"),
                "layout_after": "no fault"}
    if sig == signal.SIGTERM:  # drained: no failure to detect
        drain = next(e for e in result.events if e["event"] == "drain")
        return {**common, "detect_s": 0.0, "repair_s": drain["reform_s"],
                "kill_to_commit_s": drain["notice_to_step_s"], "layout_after": drain["new_layout"]}
    repair = next(e for e in result.events if e["event"] == "repair")
    next_commit = min(r["time"] for r in result.metrics if r.get("time", 0) > repair["detected_at"])
    return {**common, "detect_s": repair["detected_at"] - state["killed_at"], "repair_s": repair["repair_s"],
            "kill_to_commit_s": next_commit - state["killed_at"], "layout_after": repair["new_layout"]}


# --- Ray Train V2 --------------------------------------------------------------------------------


def ray_train_worker_loop(loop_config):
    import tempfile as tf

    import torch

    import ray.train
    import ray.train.torch as rtt
    from raytrain import data
    from raytrain.models.layers import build_model

    torch.set_num_threads(1)
    cfg = config([])
    spec = build_model(cfg.model, cfg.train.seed)
    model = rtt.prepare_model(torch.nn.Sequential(*spec.layers))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    start = 0
    ckpt = ray.train.get_checkpoint()
    if ckpt:
        with ckpt.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), weights_only=True)
            model.module.load_state_dict(state["model"])
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
    for step in range(start, STEPS):
        x, y = ds.batch(data.sample_ids(0, len(ds), step * GLOBAL_BATCH + rank * share, step * GLOBAL_BATCH + (rank + 1) * share))
        opt.zero_grad()
        loss = spec.loss_fn(model(x), y)
        loss.backward()
        opt.step()
        checkpoint = None
        if (step + 1) % 10 == 0 and rank == 0:
            d = tf.mkdtemp()
            torch.save({"model": model.module.state_dict(), "optim": opt.state_dict(), "step": step + 1},
                       os.path.join(d, "state.pt"))
            checkpoint = ray.train.Checkpoint.from_directory(d)
        ray.train.report({"loss": loss.item(), "step": step + 1}, checkpoint=checkpoint)
        log.write(json.dumps({"event": "step", "rank": rank, "pid": os.getpid(), "step": step + 1, "time": time.time()}) + "\n")
        log.flush()


def run_ray_train(workdir: str, progress: str) -> None:
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    TorchTrainer(
        ray_train_worker_loop, train_loop_config={"progress": progress},
        scaling_config=ScalingConfig(num_workers=(1, 2), use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=workdir, name=os.path.splitext(os.path.basename(progress))[0],
                             failure_config=FailureConfig(max_failures=3)),
    ).fit()
    ray.shutdown()


def ray_train_recovery(workdir: str, sig: int = signal.SIGKILL) -> dict:
    progress = os.path.join(workdir, f"progress-{sig}.jsonl")
    launched = time.time()
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--ray-train", workdir, "--progress", progress],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    killed_at = kill_step = None
    deadline = time.monotonic() + 900
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
        if killed_at is None and os.path.exists(progress):
            lines = [json.loads(l) for l in open(progress).read().splitlines() if l.strip()]
            steps = [l for l in lines if l["event"] == "step" and l["rank"] == 1]
            if steps and steps[-1]["step"] >= KILL_STEP:
                os.kill(steps[-1]["pid"], sig)
                killed_at, kill_step = time.time(), steps[-1]["step"]
    proc.wait(timeout=60)
    ended = time.time()
    lines = [json.loads(l) for l in open(progress).read().splitlines() if l.strip()]
    restart = min(l["time"] for l in lines if l["event"] == "start" and l["time"] > killed_at)
    resumed_at = next(l["step"] for l in lines if l["event"] == "start" and l["time"] > killed_at)
    next_commit = min(l["time"] for l in lines if l["event"] == "step" and l["time"] > killed_at)
    name = "Ray Train V2 (1..2 workers)" + (" SIGTERM" if sig == signal.SIGTERM else "")
    return {"system": name, "kill_step": kill_step, "detect_s": float("nan"),
            "repair_s": restart - killed_at, "kill_to_commit_s": next_commit - killed_at,
            "steps_lost": kill_step - resumed_at, "layout_after": "restart from checkpoint", "grew_back": None,
            "goodput": ray_train_goodput(lines, ended - launched)}


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ray-train", metavar="WORKDIR", help=argparse.SUPPRESS)
    parser.add_argument("--progress", metavar="FILE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ray_train:
        run_ray_train(args.ray_train, args.progress)
        return
    import ray

    from raytrain import data

    data.resolve_data_path(config([]))
    print(f"SIGKILL (or SIGTERM) of one worker after step {KILL_STEP} of {STEPS} (GPT 4x256, global batch "
          f"{GLOBAL_BATCH}); goodput: committed-step time over wall time from the launch")
    print(f"{'system':<32} {'fault at':>8} {'detect s':>8} {'repair s':>8} {'fault->commit s':>15} "
          f"{'steps redone':>12} {'goodput':>7}  after", flush=True)
    with tempfile.TemporaryDirectory() as workdir:
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
        show(raytrain_recovery("raytrain dp=2", ["parallel.dp=2"], workdir))
        show(raytrain_recovery("raytrain dp=2 (replace)", ["parallel.dp=2", "elastic.min_dp=2"], workdir))
        show(raytrain_recovery("raytrain dp=2 (standby)", ["parallel.dp=2", "elastic.min_dp=2", "elastic.standby=1"],
                               workdir))
        show(raytrain_recovery("raytrain dp=2 x pp=2", ["parallel.dp=2", "parallel.pp=2", "parallel.microbatches=2"],
                               workdir))
        show(raytrain_recovery("raytrain dp=2 SIGTERM (drain)", ["parallel.dp=2"], workdir, signal.SIGTERM))
        show(raytrain_recovery("raytrain dp=2 fault-free", ["parallel.dp=2"], workdir, signal.SIGCONT))
        ray.shutdown()
        show(ray_train_recovery(workdir))
        show(ray_train_recovery(workdir, signal.SIGTERM))


def show(r: dict) -> None:
    print(f"{r['system']:<32} {r['kill_step']:>8} {r['detect_s']:>8.2f} {r['repair_s']:>8.2f} "
          f"{r['kill_to_commit_s']:>15.2f} {r['steps_lost']:>12} {r['goodput']:>7.3f}  {r['layout_after']}"
          + ("" if r["grew_back"] is None else f" (grew back: {r['grew_back']})"), flush=True)

if __name__ == "__main__":
    main()
