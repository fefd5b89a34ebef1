"""The files of a dataset: data.path (or data.eval_path) resolved to a sorted list, and where each file's
samples sit in the run's global numbering.

Forms (each local or a ``pyarrow.fs`` URI: s3://, gs://, hdfs://, file://):

- one file;
- a directory: every file under it, recursively, except names starting with ``.`` or ``_`` (and what is
  under such directories), as pyarrow.dataset skips them (``_SUCCESS``, ``.crc``); any other file must be
  data, so a stray ``notes.txt`` is refused by the checks, by name, rather than skipped in silence;
- a glob (``*``, ``?``, ``[...]`` in a name; ``**`` for any depth of directories), whose wildcards skip
  hidden names as a listing does (``_tmp/*`` still reads ``_tmp``);
- a list of any of those.

Only regular files are data: a FIFO, a socket or a device (named, or under a directory) is refused by name from
its listing, before anything opens it (opening a FIFO waits for a writer, for ever). Paths keep the form of
their entry (relative stays relative, to the working directory, as a Ray job's workers resolve it in theirs).
The result is sorted by path and names each file once: a file named twice, or reached by two paths (a
symbolic or hard link: ``file_key``), would be trained on twice an epoch, and is refused; so every form of
the same files gives the same list. Files concatenate in that order:
file k's samples are global ids [offset_k, offset_k + samples_k) (``Files``). A file is JSON lines when its
name ends ``.jsonl`` or ``.json``; any other is read as Parquet.

The list is resolved once, on the driver (raytrain.driver.prepare.prepare), and travels to the workers with
each file's sample count: a worker never lists a directory, so a shard written during the run cannot
change the order (DESIGN invariant 5).
"""

from __future__ import annotations

import fnmatch
import os
import posixpath
import stat
from dataclasses import dataclass
from typing import Optional, Sequence, Union
from urllib.parse import unquote, urlparse

import numpy as np
import pyarrow.fs as pafs

JSON_LINES_SUFFIXES = (".jsonl", ".json")
HIDDEN_PREFIXES = (".", "_")
"""Names a directory listing skips (and what is under such a directory), as pyarrow.dataset does."""
GLOB_CHARS = "*?["


@dataclass(frozen=True)
class Fingerprint:
    """A data file's size and a hash of its content's ends (raytrain.data.identity makes it): what its
    decoded cache is keyed by, and what a checkpoint records of it."""

    size: int
    digest: str
    """``<SCHEME>:<hex>``."""

    def __str__(self) -> str:
        return f"{self.size}:{self.digest}"


class NumberedParts:
    """Parts (files, a Ray Dataset's blocks) whose samples are numbered as their concatenation: the
    subclass holds ``samples``, the rows of each part in order."""

    samples: tuple[int, ...]

    @property
    def offsets(self) -> np.ndarray:
        """Global id of each part's first sample, and the total last (one value more than the parts)."""
        return np.cumsum([0, *self.samples], dtype=np.int64)

    @property
    def total(self) -> int:
        return int(sum(self.samples))

    def locate(self, ids: np.ndarray) -> np.ndarray:
        """The part index of each global sample id."""
        ids = np.asarray(ids, dtype=np.int64)
        if len(ids) and (ids.min() < 0 or ids.max() >= self.total):
            raise IndexError(f"sample ids {int(ids.min())}..{int(ids.max())} outside [0, {self.total})")
        return np.searchsorted(self.offsets, ids, side="right") - 1


@dataclass(frozen=True)
class Files(NumberedParts):
    """One dataset's files in order, with the samples each holds (windows of model.seq_len + 1 tokens,
    or text's packed rows), as prepare counted them."""

    paths: tuple[str, ...]
    samples: tuple[int, ...]
    fingerprints: tuple[Fingerprint, ...] = ()
    """Each file's size and content fingerprint (raytrain.data.identity), as prepare found them: what a
    checkpoint records of the run's data. Empty where nothing will record it (a tool's count)."""

    def __post_init__(self):
        assert len(self.paths) == len(self.samples) > 0, (self.paths, self.samples)
        assert len(self.fingerprints) in (0, len(self.paths)), (self.paths, self.fingerprints)



def one_file(path: str, samples: int) -> Files:
    return Files((path,), (samples,))


# --- resolving data.path ------------------------------------------------------------------------


def resolve(spec: Union[str, Sequence[str]], key: str = "data.path") -> list[str]:
    """The sorted, duplicate-free files ``spec`` names (a file, directory, glob, or a list of those); a
    ValueError naming ``key`` and the fix when one names nothing or what is not a regular file, or when a
    file is named twice or reached by two paths. Nothing is opened: listings and stats only."""
    entries = [spec] if isinstance(spec, str) else list(spec)
    found: list[str] = []
    for entry in entries:
        try:
            files = _expand(os.path.expanduser(entry) if not is_uri(entry) else entry, key)
        except OSError as e:  # unreadable directory, missing credentials, unreachable store
            raise ValueError(f"{key}={spec!r}: cannot list {entry!r} ({e}); make it readable from this machine "
                             "(for a URI: the store's credentials), or point " + key + " elsewhere") from e
        if not files:
            raise ValueError(f"{key}={spec!r}: {entry!r} names no data file (a directory's names starting with "
                             f"'.' or '_' are skipped); point {key} at Parquet or JSON lines files, a directory or "
                             "a glob of them")
        found += files
    seen = set()
    twice = sorted({f for f in found if f in seen or seen.add(f)})
    if twice:
        raise ValueError(f"{key}={spec!r} names {twice[0]!r} more than once, so its samples would be seen twice an "
                         f"epoch; list each file once")
    found = sorted(found)
    same = _one_file_twice(found)
    if same is not None:
        raise ValueError(f"{key}={spec!r} reaches one file by two paths, {same[0]!r} and {same[1]!r} (a symbolic or "
                         "hard link), so its samples would be seen twice an epoch; keep one of them in " + key)
    return found


def file_key(path: str) -> tuple:
    """What makes two names one file: a local file's (device, inode), whatever links led to it (a symbolic
    link, a hard link, another spelling of its path); a store's URI by scheme, bucket and normalised path."""
    local = local_path(path)
    if local is not None:
        st = os.stat(local)
        return ("inode", st.st_dev, st.st_ino)
    scheme, _, rest = path.split("?")[0].partition("://")
    authority, _, where = rest.partition("/")
    return ("uri", scheme.lower(), authority, posixpath.normpath("/" + where))


def _one_file_twice(names: Sequence[str]) -> Optional[tuple[str, str]]:
    """The first two of ``names`` (distinct) that reach one file; None when each reaches its own."""
    seen: dict[tuple, str] = {}
    for name in names:
        first = seen.setdefault(file_key(name), name)
        if first != name:
            return first, name
    return None


def check_held_out_apart(train: Sequence[str], held: Sequence[str]) -> None:
    """data.eval_path's files (``held``) are none of data.path's (``train``), by name or through a link: a
    held-out row that is also trained on makes the held-out loss a training loss. (A copy is caught by its
    content: raytrain.data.identity.check_no_copies.)"""
    trained = {file_key(path): path for path in train}
    same = next(((trained[k], path) for path in held if (k := file_key(path)) in trained), None)
    if same is not None:
        raise ValueError(f"data.eval_path file {same[1]!r} is data.path's {same[0]!r} (the same file), so the held-out "
                         "loss would be measured on training rows; point data.eval_path at files outside data.path, "
                         "or hold rows out with data.eval_fraction instead")


def _expand(entry: str, key: str) -> list[str]:
    if any(c in entry for c in GLOB_CHARS):
        return _glob(entry, key)
    fs, where = filesystem(entry, key)
    info = fs.get_file_info(where)
    if info.type == pafs.FileType.NotFound:
        raise ValueError(f"{key}={entry!r}: no such file or directory; point it at a Parquet or JSON lines file, "
                         "a directory or a glob of them (or unset data.path to use the built-in corpus)")
    if info.type == pafs.FileType.Directory:
        return [_rebuild(entry, where, f) for f in _listing(fs, where, key)]
    return [_rebuild(entry, where, f) for f in _regular_files([info], key)]


def _listing(fs: pafs.FileSystem, where: str, key: str) -> list[str]:
    """Every file under the directory ``where`` (filesystem paths), hidden names and their contents skipped."""
    infos = fs.get_file_info(pafs.FileSelector(where, recursive=True))
    base = where.rstrip("/")
    return _regular_files([i for i in infos if not _hidden(i.path[len(base):])], key)


def _regular_files(infos: list[pafs.FileInfo], key: str) -> list[str]:
    """The paths of the files among ``infos`` (directories left out); a ValueError naming the first entry that
    is neither (a FIFO, a socket, a device: pyarrow's Unknown), found by its stat, never opened."""
    special = next((i.path for i in infos if i.type == pafs.FileType.Unknown), None)
    if special is not None:
        raise ValueError(f"{key}: {special!r} is {_kind(special)}, not a regular file (reading it could block the run "
                         f"for ever); point {key} at Parquet or JSON lines files only, or move it out of the directory")
    return [i.path for i in infos if i.type == pafs.FileType.File]


def _kind(path: str) -> str:
    """What a local special file is, for a message."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return "not a file"
    for test, name in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a file"


def _hidden(relative: str) -> bool:
    return any(part.startswith(HIDDEN_PREFIXES) for part in relative.split("/") if part)


def _glob(pattern: str, key: str) -> list[str]:
    """Files matching ``pattern``: the directory before its first wildcard is listed, and each file's path
    below it matched part by part (``*`` never crosses a ``/``; ``**`` matches any depth)."""
    fs, where = filesystem(pattern, key)
    parts = where.split("/")
    first = next(i for i, p in enumerate(parts) if any(c in p for c in GLOB_CHARS))
    base = "/".join(parts[:first]) or "/"
    if fs.get_file_info(base).type != pafs.FileType.Directory:
        return []
    rest = parts[first:]
    infos = fs.get_file_info(pafs.FileSelector(base, recursive=True))
    prefix = base.rstrip("/") + "/"
    matched = [i for i in infos
               if i.type != pafs.FileType.Directory and _matches(rest, i.path[len(prefix):].split("/"))]
    return [_rebuild(pattern, where, m) for m in _regular_files(matched, key)]


def _matches(pattern: list[str], parts: list[str]) -> bool:
    """A path's parts against a glob's; a wildcard never matches a hidden name (``.``/``_``, as a listing
    skips them) unless the pattern's part starts with that character too."""
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return any(_matches(pattern[1:], parts[i:]) for i in range(len(parts) + 1)
                   if not any(p.startswith(HIDDEN_PREFIXES) for p in parts[:i]))
    if not parts or not fnmatch.fnmatchcase(parts[0], pattern[0]):
        return False
    if parts[0].startswith(HIDDEN_PREFIXES) and not pattern[0].startswith(parts[0][0]):
        return False
    return _matches(pattern[1:], parts[1:])


# --- local paths and pyarrow.fs URIs ------------------------------------------------------------


def is_uri(path: str) -> bool:
    return "://" in path


def is_json_lines(path: str) -> bool:
    return path.split("?")[0].lower().endswith(JSON_LINES_SUFFIXES)


def filesystem(path: str, key: str = "data.path") -> tuple[pafs.FileSystem, str]:
    """The filesystem holding ``path`` and the path on it: the local one for a plain path (made absolute)."""
    if not is_uri(path):
        return pafs.LocalFileSystem(), os.path.abspath(path)
    try:
        return pafs.FileSystem.from_uri(path)
    except (ValueError, OSError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise ValueError(f"{key}={path!r}: not a URI pyarrow.fs can open ({e}); use a local path or an s3://, "
                         "gs://, hdfs:// or file:// URI whose credentials this machine has") from e


def _rebuild(entry: str, where: str, found: str) -> str:
    """The file at filesystem path ``found`` named as ``entry`` names its filesystem (a plain path, or the
    URI's scheme and authority before ``where``, the path on that filesystem, and its query)."""
    if not is_uri(entry):  # a relative entry gives relative paths, as before: a Ray job's workers resolve
        return found if os.path.isabs(entry) else os.path.relpath(found)  # them in their own working dir
    base, _, query = entry.partition("?")
    head = base[: len(base) - len(where)] if base.endswith(where) else base.split("://")[0] + "://"
    return head + found + (f"?{query}" if query else "")


def local_path(path: str) -> Optional[str]:
    """The path on this machine's disk of a plain path or a file:// URI (absolute); None for a store's URI."""
    if not is_uri(path):
        return os.path.abspath(path)
    if path.lower().startswith("file://"):
        return unquote(urlparse(path).path)
    return None


def regular(path: str) -> str:
    """``path`` when it is not a local special file (a FIFO, a socket, a device), checked by its stat: what
    must hold before a local data file is opened, since opening a FIFO waits for a writer, for ever."""
    local = local_path(path)
    if local is not None and os.path.exists(local) and not stat.S_ISREG(os.stat(local).st_mode):
        raise ValueError(f"{path!r} is {_kind(local)}, not a regular file (reading it could block for ever); "
                         "point data.path and data.eval_path at Parquet or JSON lines files only")
    return path


def open_input(path: str):
    """A seekable binary file of ``path`` (local: memory-mapped), for pyarrow.parquet.ParquetFile."""
    if not is_uri(regular(path)):
        return pafs.LocalFileSystem(use_mmap=True).open_input_file(os.path.abspath(path))
    fs, where = filesystem(path)
    return fs.open_input_file(where)


def open_text(path: str):
    """``path`` as UTF-8 text lines."""
    if not is_uri(regular(path)):
        return open(path, encoding="utf-8")
    import io

    fs, where = filesystem(path)
    return io.TextIOWrapper(fs.open_input_stream(where), encoding="utf-8")


def basename(path: str) -> str:
    return path.split("?")[0].rstrip("/").rsplit("/", 1)[-1]
