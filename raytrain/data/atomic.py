"""Local files that readers see whole or not at all.

Caches that several processes build at once (the built-in corpus, the decoded token rows, a
worker's copy of the driver's corpus) write under a temporary name and rename it into place.
Checkpoints and the lease go through pyarrow.fs and publish their own way (raytrain.checkpoint).
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """A temporary name beside ``path`` for the caller to write the whole file under.

    When the block ends, the file is renamed to ``path`` in one step (replacing any file there); when
    it raises, the temporary file is removed and ``path`` is left as it was. A reader of ``path``
    finds no file, the old one or the new one whole, never part of one. Parent directories are created.
    """
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"  # unique per writer: builders may race
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
