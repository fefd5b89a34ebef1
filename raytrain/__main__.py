"""``python -m raytrain``: the CLI (raytrain.cli) as a process, whose exit does not wait on a dead Ray."""

import os
import sys

from raytrain.cli import main


def _exit(code: int) -> None:
    """Exit with ``code``. When a signal to the whole process group (``timeout``, systemd, Slurm) also
    ended the embedded Ray, exit at once: ``ray.shutdown`` (atexit's too) would block on its dead GCS,
    then end the process with code 1."""
    connect = sys.modules.get("raytrain.driver.connect")  # imported by the commands that start a Ray
    if connect is not None and not connect.shutdown_embedded():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


_exit(main())
