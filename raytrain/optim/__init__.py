"""How a step is applied, the same in every layout and in the single-process reference: the
optimizer (raytrain.optim.optimizer, on the workers) at each step's learning rate
(raytrain.optim.lr_schedule, which the coordinator reports too). This package's top imports no
torch, so that importing the schedule keeps torch out of the coordinator's process."""
