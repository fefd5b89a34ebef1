"""``python -m raytrain`` (and the ``raytrain`` script): the CLI (raytrain.cli) as a process.

Its stdout holds the command's result line alone, so that line is the last one whatever Ray prints: the
process's own stdout (Ray's relayed worker logs, a model's prints) goes to stderr. A stop signal never
ends it with a traceback (raytrain.driver.signals.ProcessSignals), and its exit does not wait on a dead Ray.
"""

import os
import sys

from raytrain.cli import main
from raytrain.driver.signals import ProcessSignals, exit_code


def run() -> None:
    """Run the command of ``sys.argv`` and exit with its code."""
    sys.stdout.flush()
    results = os.fdopen(os.dup(1), "w")  # the real stdout, for the result line
    os.dup2(2, 1)  # whatever else writes to stdout, Python or C, lands on stderr
    signals = ProcessSignals().__enter__()  # for the whole process: never left
    try:
        code = main(out=results, signals=signals)
    except KeyboardInterrupt as e:  # a signal at a moment that no handler could report
        code = exit_code(getattr(e, "reason", "SIGINT"))
    signals.ended()
    signals.reported(code)
    _exit(code)


def _exit(code: int) -> None:
    """Exit with ``code``. When a signal to every process of the job (Slurm's or systemd's control group;
    a process group's spares it) also ended the embedded Ray, exit at once: ``ray.shutdown`` (atexit's
    too) would block on its dead GCS, then end the process with code 1."""
    connect = sys.modules.get("raytrain.driver.connect")  # imported by the commands that start a Ray
    if connect is not None and not connect.shutdown_embedded():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
