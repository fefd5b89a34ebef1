"""Files through ``pyarrow.fs``: a local path or an object-store URI, the same calls for both.

Every other module of the package reaches storage through these, so a URI works wherever a path does.
They call ``filesystem`` through this module (``storage.filesystem``), never a copy of it: a test that
replaces it (an in-memory object store: tests/peak_save_load.py) reaches every read and write.
"""

from __future__ import annotations

import os

import pyarrow.fs as pafs

from raytrain.checkpoint.errors import CheckpointError


def filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem of a local path or URI, and the path within it."""
    if "://" in uri:
        return pafs.FileSystem.from_uri(uri)
    return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri))


def join_uri(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *parts])


def check_writable(base: str) -> None:
    """Create ``base`` and write and delete a probe file in it, or raise CheckpointError saying why.

    Run before any actor starts, so a bad checkpoint.dir fails in seconds, not at the first save.
    """
    try:
        fs, path = filesystem(base)
        fs.create_dir(path, recursive=True)
        probe = join_uri(path, f".probe-{os.getpid()}-{os.urandom(4).hex()}")
        with fs.open_output_stream(probe) as f:
            f.write(b"raytrain")
        fs.delete_file(probe)
    except (OSError, ValueError) as e:  # pyarrow: ArrowInvalid (a ValueError) for an unknown scheme
        raise CheckpointError(f"cannot write checkpoints to {base} ({type(e).__name__}: {e})") from e


def entries(fs: pafs.FileSystem, path: str) -> list[pafs.FileInfo]:
    """What the directory ``path`` holds ([] when it does not exist or cannot be listed)."""
    try:
        return fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    except OSError:
        return []


def write_bytes(uri: str, data: bytes) -> None:
    fs, path = filesystem(uri)
    fs.create_dir(os.path.dirname(path), recursive=True)
    with fs.open_output_stream(path) as f:
        f.write(data)


def read_bytes(uri: str) -> bytes:
    fs, path = filesystem(uri)
    try:
        with fs.open_input_stream(path) as f:
            return f.read()
    except (FileNotFoundError, OSError) as e:
        raise CheckpointError(f"cannot read checkpoint file {uri}: {e}") from e
