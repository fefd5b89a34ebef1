"""Raw text as training rows: tokenised with a local Hugging Face tokenizer once per machine and packed
into rows of ``model.seq_len + 1`` tokens, cached beside the decoded token rows (raytrain.data.token_cache).

Sources: the string column ``data.text_column`` of a Parquet ``data.path``, or the key
``data.text_column`` of every line of a JSON lines ``data.path`` (``.jsonl`` or ``.json``: one JSON
object per line; blank lines are skipped). Each document is encoded without the tokenizer's own
special tokens (no per-document BOS or [CLS]/[SEP]); documents are joined in file order by the
tokenizer's end-of-text token, the first of SEPARATORS in its vocabulary (none: they are joined
directly). The stream is cut into rows of ``width`` tokens, row i holding tokens
[i * width, (i + 1) * width), and the trailing partial row is dropped. Text that spells a special
token (``<|endoftext|>``) is encoded as that token, as the tokenizers library does.

The cache key covers the source (its path and content: raytrain.data.identity.fingerprint), the column,
the width and the SHA-256 of tokenizer.json, so changing any of them builds a new cache. Only building it needs the
tokenizers library (``pip install -e '.[hf]'``); a worker that finds it built only maps it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from typing import Iterator, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raytrain.config import DataConfig
from raytrain.data import shards, token_cache
from raytrain.data.atomic import atomic_path

SEPARATORS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")
"""End-of-text tokens, in order of preference: the first one the tokenizer has separates documents."""
TOKENIZER_FILE = "tokenizer.json"
DOCS_PER_BATCH = 1024
"""Documents read and encoded at a time: building the cache holds one batch in memory, not the corpus."""
COPY_TOKENS = 1 << 24
"""Tokens copied at a time from the raw token stream into the cached array."""
FORMAT = "packed-text-v1"
"""Part of the cache key: a change to how text becomes rows must change it."""


is_json_lines = shards.is_json_lines
JSON_LINES_SUFFIXES = shards.JSON_LINES_SUFFIXES


# --- the tokenizer ----------------------------------------------------------------------------


def tokenizer_file(tokenizer_dir: str) -> str:
    """``tokenizer_dir``/tokenizer.json; a ValueError naming data.tokenizer when it is not there."""
    where = os.path.expanduser(tokenizer_dir)
    if not os.path.isdir(where):
        raise ValueError(f"data.tokenizer={tokenizer_dir!r}: no such directory; point it at a local Hugging Face "
                         f"tokenizer directory holding {TOKENIZER_FILE} (experiments/make_tokenizer.py trains one)")
    path = os.path.join(where, TOKENIZER_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"data.tokenizer={tokenizer_dir!r} holds no {TOKENIZER_FILE}; save the tokenizer there "
                         "(tokenizers: Tokenizer.save; transformers: a fast tokenizer's save_pretrained)")
    return path


def load_tokenizer(path: str):
    """The ``tokenizers.Tokenizer`` in ``path`` (a tokenizer.json), with truncation and padding off so that
    no document is cut. ImportError when the tokenizers library is missing."""
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise ImportError("text data (data.text_column) needs the tokenizers library: pip install -e '.[hf]'") from e
    try:
        tokenizer = Tokenizer.from_file(path)
    except Exception as e:  # the library raises a bare Exception for a file it cannot parse
        raise ValueError(f"data.tokenizer: {path} is not a tokenizer file the tokenizers library reads ({e}); "
                         f"point data.tokenizer at a directory holding a Hugging Face {TOKENIZER_FILE}") from e
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def vocab_extent(tokenizer) -> int:
    """The largest token id plus one: what model.vocab_size must reach."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1


def separator_id(tokenizer) -> Optional[int]:
    """The id of the first of SEPARATORS the tokenizer has, else None."""
    for token in SEPARATORS:
        found = tokenizer.token_to_id(token)
        if found is not None:
            return found
    return None


# --- the documents ----------------------------------------------------------------------------


def documents(path: str, column: str) -> Iterator[list[str]]:
    """The text of every document of ``path``, in file order, DOCS_PER_BATCH at a time."""
    return _json_documents(path, column) if is_json_lines(path) else _parquet_documents(path, column)


def _parquet_documents(path: str, column: str) -> Iterator[list[str]]:
    import pyarrow.compute as pc  # not at the top: workers that find the cache built never need it

    first = 0
    parquet = pq.ParquetFile(shards.open_input(path))
    for batch in parquet.iter_batches(batch_size=DOCS_PER_BATCH, columns=[column], use_threads=False):
        texts = batch.column(0)
        if texts.null_count:
            row = first + pc.index(texts.is_null(), True).as_py()
            raise ValueError(f"data.path={path!r}: row {row} of data.text_column={column!r} is null; "
                             "drop or fill the null rows")
        yield texts.to_pylist()
        first += len(texts)


def _json_documents(path: str, column: str) -> Iterator[list[str]]:
    docs = []
    with _utf8(path) as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                docs.append(json_text(path, column, number, line))
            if len(docs) == DOCS_PER_BATCH:
                yield docs
                docs = []
    if docs:
        yield docs


@contextlib.contextmanager
def _utf8(path: str) -> Iterator:
    """``path`` opened as UTF-8 text; a decoding error names the file."""
    try:
        with shards.open_text(path) as f:
            yield f
    except UnicodeDecodeError as e:
        raise ValueError(f"data.path={path!r} is not UTF-8 text ({e}); write JSON lines as UTF-8") from e


def json_text(path: str, column: str, number: int, line: str) -> str:
    """The text under key ``column`` of line ``number`` of a JSON lines file; a ValueError naming the line."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"data.path={path!r}: line {number} is not JSON ({e}); a data.path ending "
                         f"{' or '.join(JSON_LINES_SUFFIXES)} holds one JSON object per line") from e
    if not isinstance(record, dict) or column not in record:
        keys = f" (its keys: {sorted(record)})" if isinstance(record, dict) else ""
        raise ValueError(f"data.path={path!r}: line {number} has no key data.text_column={column!r}{keys}; "
                         "set data.text_column to the key holding the text")
    text = record[column]
    if not isinstance(text, str):
        raise ValueError(f"data.path={path!r}: line {number}: data.text_column={column!r} holds "
                         f"{type(text).__name__}, not text; point data.text_column at a string")
    return text


def check_source(path: str, column: str) -> None:
    """What can be checked without tokenising: a Parquet file's text column exists and holds strings; a
    JSON lines file's first document is text under ``column``. The rest is checked as the text is read."""
    if is_json_lines(path):
        with _utf8(path) as f:
            first = next(((n, line) for n, line in enumerate(f, 1) if line.strip()), None)
        if first is not None:
            json_text(path, column, *first)
        return
    try:
        schema = pq.ParquetFile(shards.open_input(path)).schema_arrow
    except (OSError, pa.ArrowInvalid) as e:
        raise ValueError(f"data.path={path!r} is not a readable Parquet file ({e}); text data is Parquet, or "
                         f"JSON lines in a file ending {' or '.join(JSON_LINES_SUFFIXES)}") from e
    if column not in schema.names:
        raise ValueError(f"data.text_column={column!r}: data.path={path!r} has no such column (columns: "
                         f"{schema.names}); set data.text_column to its text column")
    kind = schema.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise ValueError(f"data.text_column={column!r}: column of data.path={path!r} is {kind}, not text (string); "
                         "point data.text_column at a string column (token ids go in data.column, without "
                         "data.text_column and data.tokenizer)")


# --- tokenising and packing ---------------------------------------------------------------------


def packed_path(source: str, column: str, tokenizer_dir: str, width: int, cache_dir: str) -> str:
    """Where the packed rows live: keyed by the source, the column, the width and tokenizer.json's content."""
    with open(tokenizer_file(tokenizer_dir), "rb") as f:
        tokenizer_hash = hashlib.sha256(f.read()).hexdigest()
    return token_cache.cache_path(source, column, width, cache_dir, variant=f"{FORMAT}|{tokenizer_hash}")


def packed_rows(source: str, column: str, tokenizer_dir: str, width: int, cache_dir: str) -> np.ndarray:
    """The (N, width) packed token rows of ``source``'s text, memory-mapped read-only; tokenised the
    first time on this machine (one builder at a time, the others wait)."""
    path = packed_path(source, column, tokenizer_dir, width, cache_dir)
    file = tokenizer_file(tokenizer_dir)
    return token_cache.open_built(path, lambda out: build_packed(source, column, file, width, out))


def build_packed(source: str, column: str, tokenizer_path: str, width: int, path: str) -> None:
    """Tokenise ``source`` into a raw token stream on disk, then copy its whole rows into the ``.npy`` at
    ``path`` (written atomically). Memory stays at one batch of documents."""
    tokenizer = load_tokenizer(tokenizer_path)
    dtype = np.dtype(np.uint16 if vocab_extent(tokenizer) <= 2**16 else np.uint32)
    with atomic_path(path) as tmp:
        stream = tmp + ".stream"
        try:
            total = write_stream(tokenizer, documents(source, column), stream, dtype)
            pack(stream, total // width, width, dtype, tmp)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(stream)


def write_stream(tokenizer, batches: Iterator[list[str]], stream: str, dtype: np.dtype) -> int:
    """Append every document's ids to the file ``stream``, separated by separator_id; returns the token count."""
    separator = separator_id(tokenizer)
    started, total = False, 0
    with open(stream, "wb") as f:
        for docs in batches:
            parts = []
            for encoding in tokenizer.encode_batch_fast(docs, add_special_tokens=False):
                if started and separator is not None:
                    parts.append(np.array([separator], dtype=dtype))
                parts.append(np.asarray(encoding.ids, dtype=dtype))
                started = True
            chunk = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
            chunk.tofile(f)
            total += len(chunk)
    return total


def pack(stream: str, rows: int, width: int, dtype: np.dtype, path: str) -> None:
    """The first ``rows * width`` tokens of ``stream`` as a (rows, width) ``.npy`` at ``path``."""
    if rows == 0:
        with open(path, "wb") as f:
            np.save(f, np.zeros((0, width), dtype=dtype))
        return
    source = np.memmap(stream, dtype=dtype, mode="r", shape=(rows * width,))
    out = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=(rows, width))
    flat = out.reshape(-1)
    for start in range(0, rows * width, COPY_TOKENS):
        flat[start : start + COPY_TOKENS] = source[start : start + COPY_TOKENS]
    out.flush()
    del flat, out, source  # unmapped before the rename


# --- the driver's check -------------------------------------------------------------------------


def check_text_dataset(path: str, data: DataConfig, seq_len: int, global_batch: int, vocab_size: int,
                       key: str = "data.path") -> int:
    """Validate text data before any actor starts, building this machine's packed rows; returns their count
    (the run's samples). ValueErrors name the key (``key``: the file's, data.path or data.eval_path) or
    file and the fix."""
    try:
        return _checked_rows(path, data, seq_len, global_batch, vocab_size)
    except ValueError as e:
        if key == "data.path":
            raise
        raise ValueError(str(e).replace(f"data.path={path!r}", f"{key}={path!r}")) from e


def _checked_rows(path: str, data: DataConfig, seq_len: int, global_batch: int, vocab_size: int) -> int:
    file = tokenizer_file(data.tokenizer)
    check_source(path, data.text_column)
    try:
        tokenizer = load_tokenizer(file)
    except ImportError as e:
        raise ValueError(f"data.tokenizer={data.tokenizer!r}: {e}") from e
    extent = vocab_extent(tokenizer)
    if extent > vocab_size:
        raise ValueError(f"data.tokenizer={data.tokenizer!r} has token ids up to {extent - 1}, beyond "
                         f"model.vocab_size={vocab_size}; set model.vocab_size >= {extent}, or use a smaller tokenizer")
    width = seq_len + 1
    rows = len(packed_rows(path, data.text_column, data.tokenizer, width, data.cache_dir))
    if rows < global_batch:
        raise ValueError(f"data.path={path!r}: the text of data.text_column={data.text_column!r} packs into {rows} "
                         f"rows of model.seq_len + 1 = {width} tokens, fewer than train.global_batch={global_batch}; "
                         "add text, or lower model.seq_len or train.global_batch")
    return rows
