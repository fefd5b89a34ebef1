"""The memory estimate every run is checked against before any actor starts (raytrain.models.memory),
and the refusal of a layout that cannot fit (raytrain.driver.memory): its figures, its limit and the
degree of parallel.fsdp or parallel.pp that would fit."""

import dataclasses
import re

import pytest

from raytrain.config import load_config
from raytrain.driver import memory as driver_memory
from raytrain.driver.memory import check_memory, check_run_memory, layout_memory
from raytrain.driver.model_check import model_facts, model_layers
from raytrain.models.layers import build_model
from raytrain.models.memory import (ACTIVATION_VALUES_PER_TOKEN_WIDTH, HOST_ALLOCATOR_SLACK, PROCESS_BYTES, Widths,
                                    estimate)
from tests.helpers import stage_worker_pids

COUNTS = [1000, 4000, 4000, 1000]  # parameters per layer
WIDTHS = Widths(width=64, heads=4, seq_len=32, vocab=256)


def test_the_state_is_16_bytes_per_owned_parameter_and_fsdp_adds_the_gathered_layer():
    plain = estimate(COUNTS, pp=1, fsdp=1, micro_batch=8, microbatches=1, schedule="1f1b", widths=None)
    assert (plain.state, plain.unsharded, plain.activations) == (16 * 10_000, 0, 0)
    # a CPU worker's process, and its allocator's slack over the tensors
    assert plain.process == PROCESS_BYTES + HOST_ALLOCATOR_SLACK * 16 * 10_000
    sharded = estimate(COUNTS, pp=1, fsdp=2, micro_batch=8, microbatches=1, schedule="1f1b", widths=None)
    assert (sharded.state, sharded.unsharded) == (8 * 10_000, 8 * 4000)
    # with micro-batches, FSDP2 holds every layer's unsharded gradient until the last one's backward
    accumulating = estimate(COUNTS, pp=1, fsdp=2, micro_batch=4, microbatches=2, schedule="1f1b", widths=None)
    assert (accumulating.state, accumulating.unsharded) == (8 * 10_000, 8 * 4000 + 4 * 10_000)
    piped = estimate(COUNTS, pp=2, fsdp=1, micro_batch=8, microbatches=2, schedule="1f1b", widths=None)
    assert piped.state == 16 * 5000  # balanced cut: 1000 + 4000 | 4000 + 1000
    cut = estimate(COUNTS, pp=2, fsdp=1, micro_batch=8, microbatches=2, schedule="1f1b", widths=None, cuts=(1,))
    assert cut.state == 16 * 9000  # the configured cut, not the balanced one
    # a sharded stage whose backwards split keeps every layer gathered, with its gradient, until the
    # reduction after its last weight half (raytrain.worker.sharded.ShardedGrads.keep_unsharded)
    sharded_pipe = dict(pp=2, fsdp=2, micro_batch=4, microbatches=2, schedule="1f1b", widths=None)
    assert estimate(COUNTS, **sharded_pipe).unsharded == 8 * 4000 + 4 * 5000
    assert estimate(COUNTS, **sharded_pipe, split=True).unsharded == 8 * 5000
    background = estimate(COUNTS, pp=1, fsdp=2, micro_batch=8, microbatches=1, schedule="1f1b", widths=None,
                          async_save=True)
    assert background.snapshot == 12 * 5000
    assert background.total == pytest.approx(sharded.total + 12 * 5000 * (1 + HOST_ALLOCATOR_SLACK))
    assert "checkpoint snapshot" in background.describe() and "snapshot" not in sharded.describe()


def test_tensor_parallelism_divides_the_blocks_state_and_a_head_split_by_vocabulary():
    # COUNTS' first and last layers are an embedding and a head: whole on every tp rank unless split by
    # vocabulary (the head's split also splits its logits)
    split = estimate(COUNTS, pp=1, fsdp=1, micro_batch=8, microbatches=1, schedule="1f1b", widths=None, tp=2)
    assert split.state == 16 * (COUNTS[0] + sum(COUNTS[1:-1]) / 2 + COUNTS[-1]) and split.unsharded == 0
    head = estimate(COUNTS, pp=1, fsdp=1, micro_batch=8, microbatches=1, schedule="1f1b", widths=None, tp=2,
                    head_split=True)
    assert head.state == 16 * (COUNTS[0] + sum(COUNTS[1:]) / 2)
    # the embedding's token table (800 of its 1000 parameters here) split by vocabulary too
    table = estimate(COUNTS, pp=1, fsdp=1, micro_batch=8, microbatches=1, schedule="1f1b", widths=None, tp=2,
                     head_split=True, table_split=800)
    assert table.state == 16 * (200 + 800 / 2 + sum(COUNTS[1:]) / 2)
    wide = Widths(width=64, heads=4, seq_len=16, vocab=50_000)  # logits dominate the activations
    whole_logits, split_logits = (estimate(COUNTS, pp=1, fsdp=1, micro_batch=8, microbatches=1, schedule="1f1b",
                                           widths=wide, tp=2, head_split=h).activations for h in (False, True))
    assert whole_logits - split_logits == 4.0 * 2 * 8 * 16 * 50_000 / 2


def test_activations_follow_the_schedule_and_activation_checkpointing():
    def acts(**kw):
        args = dict(pp=2, fsdp=1, micro_batch=4, microbatches=4, schedule="1f1b", widths=WIDTHS, cuts=(2,))
        return estimate([10] * 4, **{**args, **kw}).activations

    # GPipe's first stage holds all 4 micro-batches, 1F1B's at most pp = 2 (the last stage 1, plus its logits).
    tokens = 4 * 32
    layer = 4 * ACTIVATION_VALUES_PER_TOKEN_WIDTH * tokens * 64  # fp32; no seq_len x seq_len term (SDPA)
    assert acts(schedule="gpipe") == 4 * 2 * layer + 4 * 4 * 2 * tokens * 256  # the last stage (logits) is fullest
    assert acts() == 2 * 2 * layer
    assert acts(recompute=True) < acts() / 2  # inputs kept, one layer rebuilt at a time
    # Without a pipeline, accumulation finishes a micro-batch before the next: one is held.
    assert estimate([10] * 4, pp=1, fsdp=1, micro_batch=4, microbatches=8, schedule="1f1b", widths=WIDTHS).activations \
        == estimate([10] * 4, pp=1, fsdp=1, micro_batch=4, microbatches=1, schedule="1f1b", widths=WIDTHS).activations


def test_with_virtual_stages_a_worker_holds_its_chunks_state_and_its_plans_peak_of_activations():
    # 8 layers of 10 in 4 chunks of 2: looped, worker 0 holds chunks 0 and 2; in the V, chunks 0 and 3
    args = dict(pp=2, fsdp=1, micro_batch=4, microbatches=4, widths=WIDTHS, cuts=(2, 4, 6), virtual_stages=2)
    tokens = 4 * 32
    layer = 4 * ACTIVATION_VALUES_PER_TOKEN_WIDTH * tokens * 64  # fp32; no seq_len x seq_len term (SDPA)
    logits = 4 * 2 * tokens * 256
    interleaved = estimate([10] * 8, schedule="interleaved_1f1b", **args)
    assert interleaved.state == 16 * 40
    # worker 0 holds 5 chunk activations (2(p-1) + (v-1)p + 1), worker 1 three with the logits
    assert interleaved.activations == max(5 * 2 * layer, 3 * (2 * layer + logits))
    v_shape = estimate([10] * 8, schedule="zbv", **args)
    assert v_shape.activations == 4 * (2 * layer + logits)  # worker 0 holds the last stage: its logits
    dual = estimate([10] * 8, schedule="dualpipev", **args)
    assert dual.activations == 5 * (2 * layer + logits)  # DualPipeV: one chunk activation more than ZB-V
    one_chunk = estimate([10] * 8, pp=2, fsdp=1, micro_batch=4, microbatches=4, widths=WIDTHS, cuts=(4,),
                         schedule="1f1b")
    assert one_chunk.activations == 2 * 4 * layer  # 1F1B: 2 stages of 4 layers on worker 0


def test_the_estimate_counts_every_parameter_of_the_built_in_gpt(tmp_path):
    cfg = load_config(None, ["model.n_layer=6", "model.d_model=128", "train.global_batch=8", f"run.dir={tmp_path}"])
    counts = [sum(p.numel() for p in layer.parameters()) for layer in model_layers(cfg)]
    assert len(counts) == 8  # the embedding, six blocks, the head
    assert layout_memory(cfg, cfg.layout(), counts).state == 16 * sum(counts)
    whole = build_model(cfg.model, cfg.train.seed)  # built for real: every parameter counted once
    unique = {id(p): p for layer in whole.layers for p in layer.parameters()}
    assert sum(counts) == sum(p.numel() for p in unique.values())


def _big(tmp_path, *overrides):
    return load_config(None, ["model.n_layer=24", "model.d_model=1024", "model.n_head=16", "train.global_batch=8",
                              f"run.dir={tmp_path}", *overrides])


def test_a_layout_that_cannot_fit_is_refused_with_the_estimate_the_limit_and_what_fits(tmp_path, monkeypatch):
    cfg = _big(tmp_path)  # about 0.33 B parameters: 5 GiB of training state
    monkeypatch.setattr(driver_memory, "worker_memory_bytes", lambda cfg: 2.25 * 2**30)
    with pytest.raises(ValueError) as refused:
        check_run_memory(cfg, cfg.layout(), model_facts(cfg, None))
    message = str(refused.value)
    assert message.startswith("layout dp=1 pp=1 m=1: each worker needs an estimated ")
    assert "state " in message and "more than the 2.25 GiB a worker has" in message
    assert "parallel.fsdp=4 or parallel.pp=4 would fit" in message and "resources.check_memory=false" in message
    # What it suggests does fit.
    for key in ("fsdp", "pp"):
        fitting = dataclasses.replace(cfg.layout(), mesh=dataclasses.replace(cfg.layout().mesh, **{key: 4}))
        check_run_memory(cfg, fitting, model_facts(cfg, None))
    off = dataclasses.replace(cfg, resources=dataclasses.replace(cfg.resources, check_memory=False))
    check_run_memory(off, off.layout(), model_facts(off, None))  # the user's call


def test_a_chunked_layout_that_cannot_fit_gets_a_plain_1f1b_suggestion(tmp_path, monkeypatch):
    # interleaved_1f1b at m=2 would need m a multiple of every pp tried: the hint tries plain 1F1B instead
    cfg = _big(tmp_path, "parallel.pp=2", "parallel.schedule=interleaved_1f1b", "parallel.virtual_stages=2",
               "parallel.microbatches=2")
    monkeypatch.setattr(driver_memory, "worker_memory_bytes", lambda cfg: 1 * 2**30)
    with pytest.raises(ValueError, match=r"parallel.pp=\d+ would fit \(with parallel.schedule=1f1b, virtual_stages=1\)"):
        check_run_memory(cfg, cfg.layout(), model_facts(cfg, None))


def test_nothing_fits_says_so(tmp_path):
    cfg = _big(tmp_path, "model.n_layer=2")
    counts = [sum(p.numel() for p in layer.parameters()) for layer in model_layers(cfg)]
    with pytest.raises(ValueError, match="no parallel.fsdp or parallel.pp up to the model's limits fits"):
        check_memory(cfg, cfg.layout(), counts, max_fsdp=2, limit=2**20)
    check_memory(cfg, cfg.layout(), counts, max_fsdp=2, limit=None)  # no figure (GPUs): nothing to check


@pytest.mark.ray
def test_a_run_too_big_for_the_cluster_is_refused_before_any_worker_starts(ray_session, make_config):
    from raytrain import train

    before = stage_worker_pids()
    # 48 layers of width 4096: about 10 B parameters, 150 GiB of training state on one worker.
    cfg = make_config("model.n_layer=48", "model.d_model=4096", "model.n_head=32")
    with pytest.raises(ValueError, match=r"layout dp=1 pp=1 m=1: each worker needs an estimated 1\d\d\.\d\d GiB"):
        train(cfg)
    assert stage_worker_pids() == before


@pytest.mark.parametrize("n_layer, d_model, vocab, seq_len", [(2, 32, 256, 16), (3, 48, 1000, 2048), (1, 8, 5, 4)])
def test_the_builtin_gpts_arithmetic_counts_the_built_model(n_layer, d_model, vocab, seq_len):
    """The driver's memory check counts the built-in GPT without torch: the arithmetic must be the model's."""
    import torch

    from raytrain.config import ModelConfig
    from raytrain.driver.model_check import shardable_rows
    from raytrain.models.memory import builtin_gpt_layers

    cfg = ModelConfig(n_layer=n_layer, d_model=d_model, n_head=2 if d_model % 2 == 0 else 1, vocab_size=vocab,
                      seq_len=seq_len)
    with torch.device("meta"):
        layers = build_model(cfg, 0).layers
    counted, rows = builtin_gpt_layers(n_layer, d_model, vocab, seq_len)
    assert counted == [sum(p.numel() for p in layer.parameters()) for layer in layers]
    assert rows == shardable_rows(layers)


# --- on GPUs: a device's memory, and what the GPU path adds --------------------------------------------


def _gpu_nodes(*cards: str):
    return [{"Alive": True, "Resources": {"CPU": 8.0, "GPU": 1.0, **({f"accelerator_type:{c}": 1.0} if c else {})}}
            for c in cards]


def test_a_layout_too_big_for_the_clusters_gpus_is_refused_with_what_fits(tmp_path, monkeypatch):
    monkeypatch.setattr(driver_memory.ray, "nodes", lambda: _gpu_nodes("L4", "H100"))
    cfg = _big(tmp_path, "model.n_layer=48", "model.d_model=4096", "model.n_head=32", "resources.use_gpu=true",
               "resources.bf16=true")
    # the larger card, as the device reports its memory (not the marketing 80 GB)
    assert driver_memory.worker_memory_bytes(cfg) == 79.6 * 2**30
    with pytest.raises(ValueError) as refused:
        check_run_memory(cfg, cfg.layout(), model_facts(cfg, None))
    message = str(refused.value)
    assert "more than the 79.60 GiB a worker has (one GPU of the largest kind the cluster has)" in message
    assert "CUDA, NCCL, bf16 copies and allocator slack" in message and "would fit" in message
    fits = re.search(r"parallel.fsdp=(\d+)", message)
    sharded = dataclasses.replace(cfg.layout(), mesh=dataclasses.replace(cfg.layout().mesh, fsdp=int(fits[1])))
    check_run_memory(cfg, sharded, model_facts(cfg, None))  # what it suggests fits


def test_a_card_the_table_does_not_know_is_asked_and_a_cluster_without_gpus_is_not_checked(monkeypatch):
    monkeypatch.setattr(driver_memory.ray, "nodes", lambda: _gpu_nodes("X9000"))
    monkeypatch.setattr(driver_memory, "_probe_device_memory", lambda: 24 * 2**30)
    assert driver_memory.device_memory_bytes() == 24 * 2**30
    monkeypatch.setattr(driver_memory.ray, "nodes", lambda: [{"Alive": True, "Resources": {"CPU": 8.0}}])
    assert driver_memory.device_memory_bytes() is None


def test_the_gpu_path_adds_the_cuda_context_nccl_bf16_copies_and_allocator_slack():
    from raytrain.models.memory import (ALLOCATOR_SLACK, CUDA_RUNTIME_BYTES, NCCL_BYTES, DeviceCosts)

    args = dict(pp=1, fsdp=1, micro_batch=4, microbatches=1, schedule="1f1b", widths=None)
    cpu = estimate([1000] * 4, **args)
    alone = estimate([1000] * 4, **args, device=DeviceCosts(bf16=False, peers=False))
    tensors = cpu.total - cpu.process  # on a GPU the process is host memory: not counted against the device
    assert alone.process == 0 and alone.device == pytest.approx(CUDA_RUNTIME_BYTES + ALLOCATOR_SLACK * tensors)
    bf16 = estimate([1000] * 4, **args, device=DeviceCosts(bf16=True, peers=True))
    assert bf16.device - alone.device == pytest.approx(NCCL_BYTES + 2 * 4000 * (1 + ALLOCATOR_SLACK))
