"""A tiny Hugging Face family (tests/hf_models.py) at a layout against one process, over one step in which
AdamW is plain SGD: with train.adam_eps=1e4 (far above any |g|) and lr=1e4, AdamW's first update
lr * g / (|g| + eps) is g (to |g|/eps), linear in the gradient, so a rounding difference in a gradient stays
that small. Prints the tensors whose updates (gradients) differ most, norm-wise relative.

    OMP_NUM_THREADS=1 python experiments/family_gradients.py gemma3 parallel.tp=2
    python experiments/family_gradients.py starcoder2 parallel.pp=2 parallel.microbatches=4

Run it with OMP_NUM_THREADS=1 to compare like with like: the workers run one torch thread, and the one
process on two threads sums some reductions (a LayerNorm weight's gradient over its tokens) in another order.
"""

import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests.*


def main():
    from tests.conftest import small_config
    from tests.forked_stages import run_stages
    from tests.helpers import reference_state, relative_error
    from tests.hf_models import key_bias_apart, write_hf_model

    family, layout = sys.argv[1], sys.argv[2:]
    tmp = tempfile.mkdtemp()
    path = write_hf_model(os.path.join(tmp, "model"), family)
    cfg = small_config(os.path.join(tmp, "runs"), os.path.join(tmp, "cache"), f"model.hf={path}", *layout,
                       "train.steps=1", "train.lr=1e4", "train.adam_eps=1e4", "train.grad_clip=0", "train.weight_decay=0")
    got, _ = run_stages(cfg, os.path.join(tmp, "run"))
    want, init = reference_state(cfg), reference_state(cfg, steps=0)
    got, want, init = (key_bias_apart(x)[0] for x in (got, want, init))
    errors = sorted(((relative_error(got[k] - init[k], want[k] - init[k]), k) for k in want), reverse=True)
    print(f"{family} {' '.join(layout)}: one SGD-like step, the update (= -gradient) relative to one process; worst:")
    for e, k in errors[:4]:
        print(f"  {e:.2e} {k}  (|update| {float((want[k] - init[k]).norm()):.2e})")


if __name__ == "__main__":
    main()
