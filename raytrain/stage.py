"""One pipeline stage of one data-parallel replica: its layers, optimizer, data slice and executor.

Hosted by the ``StageWorker`` actor (raytrain.worker). A worker's stage is fixed for its life; its
place in the grid is not. Contract: ``join`` a generation (collective over its members) -> optional
``load`` or ``sync_state`` -> ``run_step(step)`` for every step in order -> ``save`` on replica 0 of
each stage when asked. After a failure the coordinator may ``commit_prepared`` and call ``join``
again with a new generation; the worker keeps its parameters and optimizer state in memory.

Commit protocol (DESIGN invariant 4): a step's optimizer update happens only after every worker of
the generation has reduced and clipped its gradients and said so in a world-wide vote. A worker
whose vote failed keeps its prepared gradients; if any survivor committed, the vote had every
worker's consent, and the coordinator rolls the others forward with ``commit_prepared``.

Tensors only move through torch.distributed: activations and their gradients point-to-point
between neighbouring stages, gradients all-reduced in the stage's dp group, state broadcast from a
live peer to new members.

At each phase point (raytrain.faults.PHASES) the stage calls its ``hook``, which does nothing
unless the fault library armed it for this worker.
"""

from __future__ import annotations

import gc
import math
import os
import resource
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from raytrain import checkpoint, data, schedule, split_backward
from raytrain.config import config_from_dict
from raytrain.faults import PhaseHook, phase_hook
from raytrain.gradsync import GradientBuckets
from raytrain.mesh import Mesh, init_groups
from raytrain.model import build_model
from raytrain.optim import make_optimizer
from raytrain.rendezvous import StoreAddress

# Shape handshake: [ndim, dtype code, dims...] padded to this length.
_SHAPE_MSG_LEN = 10
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]

HookFactory = Callable[[list[str], int, int], PhaseHook]
"""(fault specs, replica, stage) -> the hook of the worker at that slot."""


class Stage:
    """The layers of one stage of one replica, and how to train them; see the module docstring."""

    def __init__(self, config: dict, data_path: str, num_samples: int, stage: int, layer_ids: list[int],
                 make_hook: HookFactory = phase_hook):
        cfg = self.cfg = config_from_dict(config)
        self.data_path, self.num_samples = data_path, num_samples
        torch.set_num_threads(cfg.resources.cpus_per_worker)
        self.device = torch.device("cuda", 0) if cfg.resources.use_gpu else torch.device("cpu")
        if cfg.resources.use_gpu:
            torch.cuda.set_device(self.device)
        self.stage = stage
        spec = build_model(cfg.model, cfg.train.seed, layer_ids)
        self.module = nn.Sequential(*spec.layers).to(self.device)
        self.loss_fn = spec.loss_fn
        self.param_names = spec.param_names()
        self.params = list(self.module.parameters())
        self.grads = GradientBuckets(self.params, None)
        self.optimizer = make_optimizer(self.params, cfg.train)
        self.dataset = None
        self.committed = 0  # steps applied so far; the next step to run
        self.prepared: Optional[int] = None  # a step whose gradients are reduced but not yet applied
        self.make_hook = make_hook
        self.hook = PhaseHook()  # called at every phase point; the last join's faults arm it
        self.generation: Optional[int] = None
        self.groups = None
        self.joins = 0  # join attempts so far, successful or not

    # --- membership ------------------------------------------------------------------------------

    def join(self, rank: int, mesh: Mesh, shares: list[int], store: StoreAddress, generation: int,
             faults: list[str]) -> dict:
        """Leave the previous generation's groups (if any) and form ``generation``'s (collective)."""
        cfg = self.cfg
        self.leave()
        self.joins += 1
        self.mesh, self.rank = mesh, rank
        self.replica, stage = mesh.coords(rank)
        assert stage == self.stage, f"worker of stage {self.stage} placed at stage {stage}"
        self.is_first, self.is_last = self.stage == 0, self.stage == mesh.pp - 1
        self.hook = self.make_hook(faults, self.replica, self.stage)
        if generation > 0:  # generation 0 is the start; a join fault names a repair's
            self.hook("join", self.committed)
        backend = "nccl" if cfg.resources.use_gpu else "gloo"
        self.groups = init_groups(mesh, rank, store, generation, backend, cfg.elastic.detect_timeout_s)
        self.generation = generation
        self.grads.group = self.groups.dp_group
        self.share = shares[self.replica]
        self.batch_offset = sum(shares[: self.replica])
        self.mb_bounds = data.microbatch_bounds(self.share, cfg.parallel.microbatches)
        self.plan = schedule.build_plan(cfg.parallel.schedule, mesh.pp, cfg.parallel.microbatches,
                                        cfg.parallel.split_backward)[self.stage]
        self.split_mbs = schedule.split_microbatches(self.plan)
        self.last_grad_action = schedule.last_gradient_action(self.plan)
        if self.dataset is None and (self.is_first or self.is_last):
            self.dataset = data.TokenDataset(self.data_path, cfg.data.column, cfg.model.seq_len, cfg.data.cache_dir)
        self.prev_rank = mesh.rank(self.replica, self.stage - 1) if not self.is_first else None
        self.next_rank = mesh.rank(self.replica, self.stage + 1) if not self.is_last else None
        self.input_tail, self.input_dtype = self._exchange_shapes()
        return {"rank": rank, "pid": os.getpid(), "params": sum(p.numel() for p in self.params),
                "node": os.uname().nodename, "committed": self.committed}

    def leave(self) -> None:
        """Drop this worker's process groups (after a failure they may be broken); state stays.

        Every reference to the groups goes, so their connections really close and peers blocked in
        a collective with this worker fail at once rather than at the timeout.
        """
        self.groups = None
        self.grads.detach_group()
        if dist.is_initialized():
            dist.destroy_process_group()
        else:
            # An init_process_group that failed (its peer died during a repair) leaves torch's
            # process-global group-name counter advanced, and only destroy_process_group (which
            # needs a successful init) resets it. Group names key the store, so a stale counter would
            # make this worker wait under different keys than its peers. No public API does this.
            dist.distributed_c10d._world.group_count = 0
        if self.joins:
            gc.collect()  # 0.1 s: worth it only once a join may have left groups behind
        self.generation = None

    def commit_prepared(self, step: int) -> int:
        """Roll forward: apply the prepared update of ``step`` (every worker voted for it)."""
        if self.prepared == step and self.committed == step:
            self.optimizer.step()
            self.committed, self.prepared = step + 1, None
        return self.committed

    def sync_state(self, src_rank: int) -> int:
        """Broadcast parameters, optimizer state and step count from ``src_rank`` to this stage's dp group."""
        group = self.groups.dp_group
        if group is None:
            return self.committed
        self._ensure_optimizer_state()
        with torch.no_grad():
            for p in self.params:
                dist.broadcast(p.data, src=src_rank, group=group)
                state = self.optimizer.state[p]
                for key in sorted(state):
                    self._broadcast_(state[key], src_rank, group)
            count = torch.tensor([self.committed], dtype=torch.long, device=self.device)
            dist.broadcast(count, src=src_rank, group=group)
        self.committed, self.prepared = int(count), None
        return self.committed

    def _broadcast_(self, tensor: torch.Tensor, src_rank: int, group) -> None:
        """Broadcast in place; a tensor off the device (AdamW keeps ``step`` on the CPU unless fused)
        travels as a device copy, since NCCL only moves device memory."""
        if tensor.device == self.device:
            dist.broadcast(tensor, src=src_rank, group=group)
        else:
            on_device = tensor.to(self.device)
            dist.broadcast(on_device, src=src_rank, group=group)
            tensor.copy_(on_device)

    def _ensure_optimizer_state(self) -> None:
        """Give a fresh optimizer AdamW's state tensors so a broadcast can fill them in place."""
        step_device = self.device if self.cfg.train.fused_optimizer else torch.device("cpu")  # where AdamW keeps it
        for p in self.params:
            if not self.optimizer.state[p]:
                self.optimizer.state[p].update(step=torch.zeros((), dtype=torch.float32, device=step_device),
                                               exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))

    def _exchange_shapes(self) -> tuple[Optional[tuple[int, ...]], Optional[torch.dtype]]:
        """Learn the per-sample shape of this stage's input from the previous stage."""
        tail = dtype = None
        if self.is_first:
            example = torch.zeros(1, self.cfg.model.seq_len, dtype=torch.long, device=self.device)
        else:
            msg = torch.zeros(_SHAPE_MSG_LEN, dtype=torch.long, device=self.device)
            dist.recv(msg, src=self.prev_rank)
            ndim, code = int(msg[0]), int(msg[1])
            tail, dtype = tuple(int(d) for d in msg[2 : 2 + ndim - 1]), _DTYPES[code]
            example = torch.zeros(1, *tail, dtype=dtype, device=self.device)
        if not self.is_last:
            with torch.no_grad(), self._autocast():
                out = self.module(example)
            msg = torch.zeros(_SHAPE_MSG_LEN, dtype=torch.long, device=self.device)
            msg[0], msg[1] = out.dim(), _DTYPES.index(out.dtype)
            msg[2 : 2 + out.dim() - 1] = torch.tensor(out.shape[1:])
            dist.send(msg, dst=self.next_rank)
        return tail, dtype

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.resources.bf16)

    # --- one step ---------------------------------------------------------------------------------

    def run_step(self, step: int, trace: bool = False) -> dict[str, Any]:
        """Run ``step``; returns its metrics with ``ok``. A failed collective returns ``ok=False``.

        A step the coordinator sent ahead of one that failed here finds no groups, or finds the
        step before it still uncommitted (its vote found a non-finite value): it is skipped.
        """
        if self.groups is None or step != self.committed:
            assert self.groups is None or step == self.committed + 1, (step, self.committed)
            return {"rank": self.rank, "step": step, "ok": False, "committed": self.committed,
                    "prepared": self.prepared, "error": "skipped: the step before it was not committed here"}
        result = {"rank": self.rank, "step": step}
        try:
            result.update(self._prepare(step, trace))
            self.prepared = step
            # World-wide vote: everyone reduced and clipped, so everyone may step; and the sum of
            # non-finite flags, so a NaN or inf loss or gradient anywhere stops the step everywhere.
            vote = torch.tensor([1.0, 0.0 if self._finite(result) else 1.0], device=self.device)
            dist.all_reduce(vote)
            if vote[1] > 0:
                self.prepared = None
                result.update(ok=False, nonfinite=True, committed=self.committed, prepared=None,
                              error="a loss or gradient norm was not finite")
                return result
            self.hook("optimizer", step)
            t0 = time.perf_counter()
            self.optimizer.step()
            self.committed, self.prepared = step + 1, None
            result["wall_s"] += time.perf_counter() - t0
            result["ok"] = True
        except RuntimeError as e:  # torch.distributed errors: a peer died or timed out
            result.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
            # Close our connections now: peers blocked on us (not on the dead worker) fail at once
            # instead of waiting out elastic.detect_timeout_s. State stays; groups re-form on join.
            self.leave()
        result.update(committed=self.committed, prepared=self.prepared)
        return result

    def _finite(self, result: dict[str, Any]) -> bool:
        """Whether this worker's share of the step (its loss, its gradients) is finite."""
        if "loss_sum" in result and not math.isfinite(result["loss_sum"]):
            return False
        if result["grad_norm"] is not None:  # the global norm: every worker sees the same value
            return math.isfinite(result["grad_norm"])
        return bool(torch.isfinite(self.grads.squared_norm()))

    def skip_step(self, step: int) -> int:
        """Count ``step`` as done without applying it (its vote found a non-finite value)."""
        assert self.committed == step and self.prepared is None, (step, self.committed, self.prepared)
        self.grads.zero()
        self.committed = step + 1
        return self.committed

    def _prepare(self, step: int, trace: bool) -> dict[str, Any]:
        """Forward and backward every micro-batch by the plan, all-reduce and clip: all but the update."""
        cfg = self.cfg
        B = cfg.train.global_batch
        t_start = time.perf_counter()
        begin, end = data.step_positions(step, B, self.batch_offset, self.batch_offset + self.share)
        ids = data.sample_ids(cfg.train.seed, self.num_samples, begin, end)
        x = y = None
        if self.dataset is not None:
            x, y = (t.to(self.device, non_blocking=True) for t in self.dataset.batch(ids))

        self.grads.zero()
        inputs: dict[int, torch.Tensor] = {}
        outputs: dict[int, torch.Tensor] = {}
        out_grads: dict[int, torch.Tensor] = {}
        input_grads: dict[int, torch.Tensor] = {}
        weight_halves: dict[int, split_backward.WeightGradients] = {}  # backwards whose W has not run
        sends = []
        loss_sum = torch.zeros((), device=self.device)
        busy_s, peak_live, events = 0.0, 0, []
        self.hook("forward", step)
        seen_backward = False

        for i, action in enumerate(self.plan):
            lo, hi = self.mb_bounds[action.mb]
            t0 = time.perf_counter()
            kind = action.kind
            if i == self.last_grad_action:  # this action fills the step's last gradients: buckets reduce as they fill
                self.grads.arm()
            if kind == schedule.RECV_F:
                buf = torch.empty(hi - lo, *self.input_tail, dtype=self.input_dtype, device=self.device)
                dist.recv(buf, src=self.prev_rank)
                inputs[action.mb] = buf.requires_grad_(buf.is_floating_point())
            elif kind == schedule.FORWARD:
                inp = x[lo:hi] if self.is_first else inputs[action.mb]
                with self._autocast():
                    out = self.module(inp)
                if self.is_last:
                    loss = self.loss_fn(out, y[lo:hi])
                    loss_sum += loss.detach() * (hi - lo)
                    out = loss * ((hi - lo) / B)  # share of the global batch: grads then just sum
                outputs[action.mb] = out
                peak_live = max(peak_live, len(outputs) + len(weight_halves))
            elif kind == schedule.SEND_F:
                sends.append(dist.isend(outputs[action.mb].detach().contiguous(), dst=self.next_rank))
            elif kind == schedule.RECV_B:
                grad = torch.empty_like(outputs[action.mb])
                dist.recv(grad, src=self.next_rank)
                out_grads[action.mb] = grad
            elif kind == schedule.BACKWARD:
                if not seen_backward:
                    self.hook("backward", step)
                    seen_backward = True
                out = outputs.pop(action.mb)
                out_grad = None if self.is_last else out_grads.pop(action.mb)
                if action.mb in self.split_mbs:
                    input_grads[action.mb], weight_halves[action.mb] = split_backward.backward_input(
                        out, out_grad, inputs.pop(action.mb), self.params)
                else:
                    out.backward(out_grad)
                    if not self.is_first:
                        input_grads[action.mb] = inputs.pop(action.mb).grad
            elif kind == schedule.SEND_B:
                sends.append(dist.isend(input_grads.pop(action.mb).contiguous(), dst=self.prev_rank))
            elif kind == schedule.WEIGHT:
                weight_halves.pop(action.mb).run()
            t1 = time.perf_counter()
            if kind in schedule.COMPUTE:
                busy_s += t1 - t0
            if trace:
                events.append((repr(action), t0, t1))
        for work in sends:
            work.wait()
        t_sync = time.perf_counter()
        self.hook("allreduce", step)  # peers are all-reducing now
        self.grads.finish()
        t_reduced = time.perf_counter()
        grad_norm = self._clip_gradients()
        t_end = time.perf_counter()
        if trace:
            events += [("allreduce wait", t_sync, t_reduced), ("clip", t_reduced, t_end)]
        result = {
            "busy_s": busy_s, "wall_s": t_end - t_start,
            "pipeline_s": t_sync - t_start, "peak_live": peak_live, "grad_norm": grad_norm,
            "samples": len(ids), "positions": (begin, end), "peak_mem_mb": self._peak_memory_mb(),
        }
        if self.is_last:
            result["loss_sum"] = float(loss_sum)
        if trace:
            result["events"] = [(name, a - t_start, b - t_start) for name, a, b in events]
        if cfg.run.record_samples and self.is_first:
            result["sample_ids"] = ids
        return result

    def _peak_memory_mb(self) -> float:
        """Peak device memory (GPU) or peak resident set (CPU) of this worker so far."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def _clip_gradients(self) -> Optional[float]:
        """Global gradient norm over all stages (the dp replicas already agree), clipped to train.grad_clip.

        With clipping off the norm is not computed (None): it is a full pass over the gradients.
        """
        clip = self.cfg.train.grad_clip
        if clip == 0:
            return None
        sq = self.grads.squared_norm()
        if self.groups.pp_group is not None:
            dist.all_reduce(sq, group=self.groups.pp_group)
        norm = float(sq.sqrt())
        coef = clip / (norm + 1e-6)
        if coef < 1.0:
            self.grads.scale_(coef)
        return norm

    # --- state ----------------------------------------------------------------------------------

    def shard(self) -> dict[str, Any]:
        """This stage's model and optimizer state, keyed by global parameter name, on the CPU."""
        model = {n: p.detach().cpu().clone() for n, p in zip(self.param_names, self.params)}
        return {
            "model": model,
            "optim": checkpoint.optimizer_state_by_name(self.optimizer, self.param_names),
            "rng": torch.get_rng_state(),
        }

    def save(self, ckpt_dir: str) -> dict:
        shard, name = self.shard(), checkpoint.shard_name(self.stage)
        self.hook("checkpoint", self.committed, file=checkpoint.join_uri(ckpt_dir, name))
        size = checkpoint.save_shard(ckpt_dir, self.stage, shard)
        finite = all(bool(torch.isfinite(t).all()) for t in shard["model"].values()) and all(
            bool(torch.isfinite(t).all()) for state in shard["optim"].values() for t in state.values())
        return {"file": name, "bytes": size, "finite": finite}

    def load(self, ckpt_dir: str) -> None:
        """Take this stage's parameters and optimizer state from any layout's checkpoint."""
        state = checkpoint.merged_state(ckpt_dir)
        missing = [n for n in self.param_names if n not in state["model"]]
        if missing:
            raise checkpoint.CheckpointError(
                f"{ckpt_dir} lacks parameters {missing[:3]} of this model: was it written by another model config?"
            )
        with torch.no_grad():
            for name, p in zip(self.param_names, self.params):
                src = state["model"][name]
                if src.shape != p.shape:
                    raise checkpoint.CheckpointError(f"{ckpt_dir}: {name} has shape {tuple(src.shape)}, model has {tuple(p.shape)}")
                p.copy_(src)
        checkpoint.load_optimizer_state(self.optimizer, self.param_names, state["optim"])
        if state["rng"] is not None:
            torch.set_rng_state(state["rng"])
        self.committed, self.prepared = checkpoint.read_manifest(ckpt_dir)["step"], None

    def shutdown(self) -> None:
        self.leave()
