"""The design documents' networks as model factories: an MLP classifier and a linear regression.

``classifier`` is ``Linear(inputs, hidden) -> ReLU -> Linear(hidden, classes)``, the network ../shared/seeds
use to explain data and model parallelism; it trains with cross entropy on integer class ids (the default
loss). ``regression`` is ``Linear(inputs, outputs)``, trained with mean squared error on float targets
(the default loss for them). Their widths are model.options (``inputs``, ``hidden``, ``classes``,
``outputs``): a pipeline stage is built before it sees a sample, so a factory is told its widths.
"""

from torch import nn


def classifier(model):
    o = {"inputs": 64, "hidden": 100, "classes": 10, **model.options}
    return nn.Sequential(nn.Linear(o["inputs"], o["hidden"]), nn.ReLU(), nn.Linear(o["hidden"], o["classes"]))


def regression(model):
    o = {"inputs": 10, "outputs": 2, **model.options}
    return nn.Sequential(nn.Linear(o["inputs"], o["outputs"]))
