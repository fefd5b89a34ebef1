"""The errors of the checkpoint package: one for a checkpoint that cannot be trusted, one for one that cannot be written."""


class CheckpointError(ValueError):
    """A checkpoint is missing, partial or corrupt; the message names the file."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint file could not be written (a full disk, a store refusing it): its message names the file
    and the cause; the checkpoints already published stay as they are."""
