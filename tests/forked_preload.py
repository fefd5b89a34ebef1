"""Imported once by the forked-stage harness's forkserver, before it forks any worker.

As a ``StageWorker`` starts (``raytrain.worker.actor.import_torch_uncollected``): torch, dynamo and the
stage imported with the cyclic collector paused, then frozen, so no worker's full collection (a
stage's ``leave`` runs one) walks them. Two more imports every forked worker would otherwise pay for
itself: Hugging Face's shared modelling code, which a Hugging Face stage imports as it builds its model
(about a second of CPU), and the harness, which each worker unpickles its target from (it imports Ray
through raytrain.driver.prepare: a fifth of a second).
"""

import gc

gc.disable()
try:
    import torch._dynamo  # noqa: F401

    import raytrain.worker.stage  # noqa: F401
    import tests.forked_stages  # noqa: F401

    try:
        import transformers.modeling_utils  # noqa: F401
    except ImportError:  # without transformers the Hugging Face tests skip themselves
        pass
finally:
    gc.freeze()
    gc.enable()
