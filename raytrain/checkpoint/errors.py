"""The one error of the checkpoint package."""


class CheckpointError(ValueError):
    """A checkpoint is missing, partial or corrupt; the message names the file."""
