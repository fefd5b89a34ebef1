"""A file written through ``atomic_path`` is absent, the old one or the new one whole: never part of one."""

import os
import threading
import time

import pytest

from raytrain.data.atomic import atomic_path

OLD, NEW = b"old " * 50_000, b"new " * 250_000
CHUNK = 4096


def _write_slowly(tmp: str, blob: bytes, halfway=None, pause_s: float = 0.0) -> None:
    with open(tmp, "wb") as f:
        for i in range(0, len(blob), CHUNK):
            f.write(blob[i:i + CHUNK])
            f.flush()
            time.sleep(pause_s)  # > 0: lets a reader thread run between the chunks
            if halfway is not None and i == len(blob) // 2 // CHUNK * CHUNK:
                halfway()


def test_the_target_is_absent_until_whole(tmp_path):
    path = str(tmp_path / "deep" / "cache.bin")  # missing parents are made

    def halfway():
        assert not os.path.exists(path)

    with atomic_path(path) as tmp:
        _write_slowly(tmp, NEW, halfway)
        assert not os.path.exists(path)
    assert open(path, "rb").read() == NEW
    assert os.listdir(os.path.dirname(path)) == ["cache.bin"]  # no temporary left


def test_a_reader_never_sees_a_half_file(tmp_path):
    path = str(tmp_path / "cache.bin")
    seen, reading, done = set(), threading.Event(), threading.Event()

    def read():
        while not done.is_set():
            reading.set()
            try:
                with open(path, "rb") as f:
                    seen.add(f.read())
            except FileNotFoundError:
                seen.add(None)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        assert reading.wait(timeout=30)
        for blob in (OLD, NEW, OLD, NEW):
            with atomic_path(path) as tmp:
                _write_slowly(tmp, blob, pause_s=0.0002)
    finally:
        done.set()
        reader.join(timeout=30)
    assert seen <= {None, OLD, NEW}, sorted(-1 if s is None else len(s) for s in seen)
    assert len(seen) > 1  # the reader ran while the writes went on


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = str(tmp_path / "cache.bin")
    with atomic_path(path) as tmp:
        _write_slowly(tmp, OLD)
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_path(path) as tmp:
            _write_slowly(tmp, NEW[:len(NEW) // 2])
            raise RuntimeError("disk full")
    assert open(path, "rb").read() == OLD
    assert os.listdir(tmp_path) == ["cache.bin"]
