"""The split backward gives the gradients of an ordinary backward, in two halves."""

import copy

import pytest
import torch
from torch import nn

from raytrain.config import ModelConfig
from raytrain.models.layers import build_model
from raytrain.pipeline.split_backward import backward_input


def _stage_and_batch():
    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=2, d_model=32, n_head=4, seq_len=16, vocab_size=64)
    spec = build_model(cfg, 0, [2, 3])  # the second block and the head: a last stage
    x = torch.randn(3, 16, 32)
    y = torch.randint(0, 64, (3, 16))
    return nn.Sequential(*spec.layers), spec.loss_fn, x, y


def _loss(stage, loss_fn, inp, y, bf16):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        return loss_fn(stage(inp), y)


@pytest.mark.parametrize("bf16", [False, True])
def test_halves_give_the_gradients_of_one_backward(bf16):
    stage, loss_fn, x, y = _stage_and_batch()
    twin = copy.deepcopy(stage)
    inp = x.clone().requires_grad_()
    _loss(stage, loss_fn, inp, y, bf16).backward()

    inp2 = x.clone().requires_grad_()
    weights = list(twin.parameters())
    grad, weight_half = backward_input(_loss(twin, loss_fn, inp2, y, bf16), None, inp2)
    torch.testing.assert_close(grad, inp.grad, rtol=0, atol=0)
    assert all(w.grad is None for w in weights), "the input half must not touch weight gradients"
    weight_half.run()
    for (name, p), q in zip(stage.named_parameters(), weights):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=name)


def test_weight_half_accumulates_and_fires_post_accumulate_hooks():
    # Gradient buckets start their all-reduce from these hooks, so the weight half must fire them.
    stage, loss_fn, x, y = _stage_and_batch()
    weights = list(stage.parameters())
    fired = []
    for w in weights:
        w.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    halves = []
    for _ in range(2):  # two micro-batches accumulate
        inp = x.clone().requires_grad_()
        halves.append(backward_input(_loss(stage, loss_fn, inp, y, False), None, inp)[1])
    assert fired == []
    for half in halves:
        half.run()
    assert len(fired) == 2 * len(weights)
    once = copy.deepcopy(stage)
    for p in once.parameters():
        p.grad = None
    inp = x.clone().requires_grad_()
    _loss(once, loss_fn, inp, y, False).backward()
    for p, q in zip(once.parameters(), weights):
        torch.testing.assert_close(q.grad, 2 * p.grad)


class TiedTwice(nn.Module):
    """One weight used at two depths: the weight half of one use would recompute the path to the other."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x))).sum()


def test_a_weight_used_twice_falls_back_to_one_whole_backward():
    torch.manual_seed(0)
    model, x = TiedTwice(), torch.randn(4, 8)
    twin = copy.deepcopy(model)
    inp = x.clone().requires_grad_()
    model(inp).backward()
    inp2 = x.clone().requires_grad_()
    grad, weight_half = backward_input(twin(inp2), None, inp2)
    weight_half.run()  # nothing left to do, and harmless
    torch.testing.assert_close(grad, inp.grad)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(q.grad, p.grad)


def test_seeded_by_the_next_stages_gradient():
    stage, _, x, _ = _stage_and_batch()
    body = stage[0]  # one block: output is an activation, seeded by a gradient from downstream
    twin = copy.deepcopy(body)
    seed = torch.randn(3, 16, 32)
    inp = x.clone().requires_grad_()
    body(inp).backward(seed)
    inp2 = x.clone().requires_grad_()
    grad, weight_half = backward_input(twin(inp2), seed, inp2)
    weight_half.run()
    torch.testing.assert_close(grad, inp.grad, rtol=0, atol=0)
    for p, q in zip(body.parameters(), twin.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0)


def test_a_tensor_parallel_stage_splits_too(tmp_path):
    # parallelize_module's DTensor parameters (a tp mesh of one rank: the graph of tp=2, in one process),
    # the head's logits split by vocabulary and the loss on them in loss_parallel, as the executor runs it
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from raytrain.worker.tensor_parallel import parallelize_layers

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        stage, loss_fn, x, y = _stage_and_batch()
        twin = copy.deepcopy(stage)
        stage, twin = (nn.Sequential(*parallelize_layers(list(s), mesh, sequence=False)) for s in (stage, twin))
        inp = x.clone().requires_grad_()
        inp2 = x.clone().requires_grad_()
        weights = list(twin.parameters())
        with loss_parallel():
            _loss(stage, loss_fn, inp, y, False).backward()
            grad, weight_half = backward_input(_loss(twin, loss_fn, inp2, y, False), None, inp2)
            assert len(weight_half._calls) > 0 and all(w.grad is None for w in weights), "it fell back to one backward"
            weight_half.run()
        torch.testing.assert_close(grad, inp.grad, rtol=0, atol=0)
        assert any(isinstance(w, DTensor) for w in weights)
        whole = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731 - norms stay plain
        for (name, p), q in zip(stage.named_parameters(), weights):
            torch.testing.assert_close(whole(q.grad), whole(p.grad), rtol=0, atol=0, msg=name)
    finally:
        dist.destroy_process_group()
