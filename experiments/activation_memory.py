"""The activation memory of the built-in GPT, measured, against raytrain.models.memory's activation term.

In a fresh process of one torch thread: the model and AdamW take one step at batch 1 (state allocated), then
one forward and backward at ``batch``; the rise of the peak resident memory is what that batch's activations
needed. Prints it beside the estimate's activation term for the same model and batch (one micro-batch, no
pipeline), and the values per token and unit of width per block that the measurement implies.

    python experiments/activation_memory.py 12 768 12 256 8      # n_layer d_model n_head seq_len batch
"""

from __future__ import annotations

import gc
import os
import resource
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    import torch

    from raytrain.config import ModelConfig
    from raytrain.models.layers import full_model
    from raytrain.models.memory import Widths, activation_bytes

    n_layer, d_model, n_head, seq_len, batch = (int(a) for a in sys.argv[1:6])
    torch.set_num_threads(1)
    model = full_model(ModelConfig(n_layer=n_layer, d_model=d_model, n_head=n_head, seq_len=seq_len,
                                   vocab_size=256), 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(rows: int) -> None:
        ids = torch.randint(0, 256, (rows, seq_len + 1))
        logits = model(ids[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    step(1)
    step(1)
    gc.collect()
    before = peak_bytes()
    step(batch)
    measured = peak_bytes() - before
    estimated = activation_bytes(Widths(d_model, n_head, seq_len, 256), batch, n_layer + 2, False, True, 1)
    per_block = measured / (batch * seq_len * n_layer * d_model * 4)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, batch {batch} x {seq_len}: "
          f"activations measured {measured / 2**30:.2f} GiB, estimated {estimated / 2**30:.2f} GiB "
          f"({estimated / measured:.2f}x); measured {per_block:.1f} fp32 values per token and unit of width per block")


if __name__ == "__main__":
    main()
