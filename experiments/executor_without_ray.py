"""raytrain's worker code with Ray taken away: its ``Stage`` executor in plain torchrun processes.

The benchmarks run it next to raytrain proper to split raytrain's distance from torchrun DDP or
torch.distributed.pipelining into what its executor costs (this row against the baseline) and
what running inside Ray costs (raytrain against this row): Ray's own processes, the coordinator's
messages, the actor runtime. Same config, data, stage cut and process groups as a raytrain run;
the rendezvous store is rank 0's instead of the driver's.

    python -m torch.distributed.run --nproc_per_node 2 experiments/executor_without_ray.py RUN.json OUT.json
    # RUN.json: {"config": Config.to_dict(), "stage_layers": [[[layer ids of stage 0's chunk 0], ...], ...]}
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

STORE_PORT = 29546


def main(run_file: str, out_file: str) -> None:
    import torch.distributed as dist

    from raytrain import data
    from raytrain.config import config_from_dict
    from raytrain.config.prepared import Slot, WorkerSpec
    from raytrain.driver.rendezvous import StoreAddress
    from raytrain.worker.stage import Stage

    with open(run_file) as f:
        run = json.load(f)
    cfg = config_from_dict(run["config"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    mesh = cfg.layout().mesh
    assert mesh.world_size == world, f"the layout needs {mesh.world_size} processes, torchrun started {world}"
    source = data.counted_source(cfg)
    num_samples = data.training_rows(cfg, source.train.total)
    if rank == 0:
        server = dist.TCPStore("127.0.0.1", STORE_PORT, is_master=True, wait_for_workers=False)  # noqa: F841
    spec = WorkerSpec(cfg=cfg, source=source, num_samples=num_samples, stage_layers=run["stage_layers"])
    worker = Stage(spec, Slot(mesh.coords(rank)[1]))
    worker.join(rank, mesh, data.even_shares(cfg.train.global_batch, mesh.dp),
                StoreAddress("127.0.0.1", STORE_PORT, "bench"), generation=0, faults=[])
    step_end = []
    for step in range(cfg.train.steps):
        result = worker.run_step(step)
        assert result["ok"], result
        step_end.append(time.time())
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump({"step_end": step_end}, f)
    dist.barrier()
    worker.shutdown()


def launch(cfg, stage_layers: list[list[list[int]]], workdir: str, name: str) -> list[float]:
    """Run ``cfg`` with this module under torchrun; returns the end time of every step."""
    run_file, out_file = os.path.join(workdir, f"{name}-run.json"), os.path.join(workdir, f"{name}-out.json")
    with open(run_file, "w") as f:
        json.dump({"config": cfg.to_dict(), "stage_layers": stage_layers}, f)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(cfg.layout().world_size),
           "--master_port", "29547", os.path.abspath(__file__), run_file, out_file]
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise RuntimeError(f"executor without Ray failed:\n{proc.stderr[-3000:]}")
    with open(out_file) as f:
        return json.load(f)["step_end"]


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
