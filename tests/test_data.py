"""Sample order and exactly-once consumption (DESIGN invariant 5)."""

import os

import numpy as np
import pyarrow.parquet as pq
import pytest

from raytrain import data, train
from raytrain.data import token_checks
from raytrain.config import load_config


def test_order_is_a_pure_function_of_seed_and_epoch():
    a = data.sample_ids(seed=7, num_samples=50, start=0, stop=120)
    assert a == data.sample_ids(seed=7, num_samples=50, start=0, stop=120)
    assert a != data.sample_ids(seed=8, num_samples=50, start=0, stop=120)
    # each epoch is a permutation, and epochs differ in order
    assert sorted(a[:50]) == list(range(50)) and sorted(a[50:100]) == list(range(50))
    assert a[:50] != a[50:100]
    # any split of a range of positions gives the same ids in the same order
    assert data.sample_ids(7, 50, 0, 37) + data.sample_ids(7, 50, 37, 120) == a


def test_replica_slices_are_contiguous_and_cover_the_batch():
    assert data.replica_slices(12, [4, 4, 4]) == [(0, 4), (4, 8), (8, 12)]
    assert data.replica_slices(7, data.even_shares(7, 3)) == [(0, 3), (3, 5), (5, 7)]
    assert data.microbatch_bounds(6, 3) == [(0, 2), (2, 4), (4, 6)]


def test_builtin_corpus_is_built_once_and_cached(make_config):
    cfg = make_config()
    path = data.resolve_data_path(cfg)
    mtime = __import__("os").path.getmtime(path)
    assert data.resolve_data_path(cfg) == path and __import__("os").path.getmtime(path) == mtime
    table = pq.read_table(path)
    assert table.num_rows > 100 and table.schema.field("tokens").type.byte_width == cfg.model.seq_len + 1
    ds = data.TokenDataset(path, "tokens", cfg.model.seq_len)
    x, y = ds.batch([0, 5])
    assert x.shape == (2, 16) and bool((x[:, 1:] == y[:, :-1]).all())
    assert int(x.max()) < 256


def test_dataset_problems_name_the_file(tmp_path):
    rows = np.arange(10 * 5).reshape(10, 5)
    path = str(tmp_path / "short.parquet")
    data.write_token_parquet(path, rows)
    with pytest.raises(ValueError, match="short.parquet.*need >= model.seq_len"):
        data.check_dataset(path, "tokens", seq_len=16, global_batch=4, vocab_size=256)
    with pytest.raises(ValueError, match="no column 'ids'"):
        data.check_dataset(path, "ids", seq_len=4, global_batch=4, vocab_size=256)
    with pytest.raises(ValueError, match="fewer than train.global_batch"):
        data.check_dataset(path, "tokens", seq_len=4, global_batch=64, vocab_size=256)
    not_parquet = tmp_path / "x.parquet"
    not_parquet.write_text("hello")
    with pytest.raises(ValueError, match="not a readable Parquet file"):
        data.check_dataset(str(not_parquet), "tokens", seq_len=4, global_batch=4, vocab_size=256)


def test_every_sample_exactly_once_per_epoch(ray_session, make_config, tmp_path):
    """At dp=3 (the fault tests assert the same at dp=2, across repairs; the order and the replicas'
    slices are tested without processes above)."""
    num_samples, B, dp = 48, 6, 3
    rng = np.random.default_rng(0)
    path = str(tmp_path / "tokens.parquet")
    data.write_token_parquet(path, rng.integers(0, 256, size=(num_samples, 17)))
    steps = 12  # one and a half epochs
    cfg = make_config(f"data.path={path}", f"parallel.dp={dp}", f"train.global_batch={B}",
                      f"train.steps={steps}", "run.record_samples=true")
    result = train(cfg)
    consumed = [i for row in result.metrics for i in row["sample_ids"]]
    assert len(consumed) == steps * B
    first_epoch, second_half = consumed[:num_samples], consumed[num_samples:]
    assert sorted(first_epoch) == list(range(num_samples))
    assert len(set(second_half)) == len(second_half) == steps * B - num_samples


def test_byte_and_list_columns_give_the_same_batches(tmp_path):
    # The built-in corpus stores each row as fixed_size_binary (flat in Parquet, fast to decode);
    # a user's list<int> column, or plain binary, must read as the same tokens.
    import pyarrow as pa

    rows = np.random.default_rng(1).integers(0, 256, size=(12, 9)).astype(np.uint8)
    paths = {kind: str(tmp_path / f"{kind}.parquet") for kind in ("list", "fsb", "binary")}
    data.write_token_parquet(paths["list"], rows)
    raw = pa.py_buffer(rows.tobytes())
    pq.write_table(pa.table({"tokens": pa.FixedSizeBinaryArray.from_buffers(pa.binary(9), 12, [None, raw])}), paths["fsb"])
    pq.write_table(pa.table({"tokens": pa.array([r.tobytes() for r in rows], type=pa.binary())}), paths["binary"])
    batches = {}
    for kind, path in paths.items():
        assert data.check_dataset(path, "tokens", seq_len=8, global_batch=4, vocab_size=256) == 12
        with pytest.raises(ValueError, match=f"{kind}.parquet.*need >= model.seq_len \\+ 1 = 10 tokens, row 0 has 9"):
            data.check_dataset(path, "tokens", seq_len=9, global_batch=4, vocab_size=256)
        batches[kind] = data.TokenDataset(path, "tokens", seq_len=8).batch([3, 0, 11])
        x, y = data.TokenDataset(path, "tokens", seq_len=6).batch([2])  # rows longer than needed are cut
        assert x.tolist() == rows[[2], :6].tolist() and y.tolist() == rows[[2], 1:7].tolist()
    for x, y in batches.values():
        assert x.dtype == y.dtype == __import__("torch").int64
        assert x.tolist() == rows[[3, 0, 11], :8].tolist() and y.tolist() == rows[[3, 0, 11], 1:].tolist()


def test_a_column_of_the_wrong_type_is_named(tmp_path):
    import pyarrow as pa

    path = str(tmp_path / "floats.parquet")
    pq.write_table(pa.table({"tokens": pa.array([0.5] * 8)}), path)
    with pytest.raises(ValueError, match="floats.parquet.*column 'tokens' is double; it needs a list of integer"):
        data.check_dataset(path, "tokens", seq_len=4, global_batch=4, vocab_size=256)


def test_workers_decode_once_per_machine_and_map_the_same_file(tmp_path):
    # With a cache_dir (as workers read), the rows are decoded once into a .npy that every later
    # reader memory-maps; a rewritten dataset gets a new cache; the tokens are the same either way.
    from concurrent.futures import ProcessPoolExecutor

    from raytrain.data import token_cache

    rows = np.random.default_rng(2).integers(0, 300, size=(40, 9))
    path, cache = str(tmp_path / "ids.parquet"), str(tmp_path / "cache")
    data.write_token_parquet(path, rows)
    with ProcessPoolExecutor(3) as pool:  # three "workers" at once: one builds, the others wait for it
        shapes = list(pool.map(_rows_shape_via_cache, [(path, cache)] * 3))
    assert shapes == [(40, 9)] * 3
    cached = token_cache.cache_path(path, "tokens", 9, cache)
    name = os.path.basename(cached)
    assert sorted(os.listdir(os.path.dirname(cached))) == [name, name + ".lock"]  # one file, no temporaries left
    ds = data.TokenDataset(path, "tokens", seq_len=8, cache_dir=cache)
    assert isinstance(ds.rows, np.memmap) and ds.rows.dtype == np.uint16  # ids < 300: two bytes each
    direct = data.TokenDataset(path, "tokens", seq_len=8)
    assert [t.tolist() for t in ds.batch([5, 39, 0])] == [t.tolist() for t in direct.batch([5, 39, 0])]

    built = os.path.getmtime(cached)
    assert data.TokenDataset(path, "tokens", seq_len=8, cache_dir=cache).rows.shape == (40, 9)
    assert os.path.getmtime(cached) == built  # not rebuilt
    data.write_token_parquet(path, rows[:20] + 1)  # the dataset is rewritten
    fresh = data.TokenDataset(path, "tokens", seq_len=8, cache_dir=cache)
    assert token_cache.cache_path(path, "tokens", 9, cache) != cached
    assert fresh.batch([3])[0].tolist() == (rows[[3], :8] + 1).tolist()


def _rows_shape_via_cache(args):
    path, cache = args
    return data.TokenDataset(path, "tokens", seq_len=8, cache_dir=cache).rows.shape


# --- token values: type, nulls, row lengths and range, checked before any actor starts ------------

GOOD_ROWS = [list(range(i, i + 9)) for i in range(10)]  # 10 rows of 9 ids in [0, 18]: seq_len=8 fits


def _with(row: int, value) -> list:
    rows = [list(r) for r in GOOD_ROWS]
    rows[row] = value
    return rows


def _write_tokens(path, array, **kwargs) -> str:
    import pyarrow as pa

    pq.write_table(pa.table({"tokens": array}), str(path), **kwargs)
    return str(path)


@pytest.mark.parametrize("statistics", [True, False], ids=["with-stats", "no-stats"])
@pytest.mark.parametrize(
    "case, rows, vocab_size, must_mention",
    [
        ("too_large", _with(5, [1] * 8 + [300]), 256,
         ["column 'tokens'", "token ids from 0 to 300", "model.vocab_size=256", "raise model.vocab_size to 301"]),
        ("negative", _with(7, [3, -2] + [1] * 7), 256,
         ["column 'tokens'", "token ids from -2 to 17", "model.vocab_size=256", "must be >= 0", "fix the data"]),
        ("too_large_for_a_small_vocab", GOOD_ROWS, 17, ["token ids from 0 to 17", "raise model.vocab_size to 18"]),
        ("ragged", _with(3, [1, 2, 3, 4, 5]), 256,
         ["model.seq_len + 1 = 9 tokens, row 3 has 5", "lower model.seq_len"]),
        ("empty_row", _with(9, []), 256, ["row 9 has 0"]),
        ("null_row", _with(2, None), 256, ["row 2 of column 'tokens' is null", "drop or fill"]),
        ("null_value", _with(4, [1, 2, None] + [3] * 6), 256, ["row 4 of column 'tokens' holds a null token id"]),
    ],
)
def test_bad_token_rows_name_the_file_the_row_and_the_fix(tmp_path, case, rows, vocab_size, must_mention, statistics):
    import pyarrow as pa

    path = _write_tokens(tmp_path / f"{case}.parquet", pa.array(rows, type=pa.list_(pa.int64())),
                         write_statistics=statistics)
    with pytest.raises(ValueError) as err:
        data.check_dataset(path, "tokens", seq_len=8, global_batch=4, vocab_size=vocab_size)
    assert f"data.path='{path}'" in str(err.value)
    for text in must_mention:
        assert text in str(err.value), f"{text!r} missing from: {err.value}"


@pytest.mark.parametrize(
    "case, array, vocab_size, must_mention",
    [
        ("string", lambda pa: pa.array(["a" * 9] * 10), 256,
         ["column 'tokens' is string; it needs a list of integer token ids", "data.column"]),
        ("list_of_string", lambda pa: pa.array([["a"] * 9] * 10), 256,
         ["column 'tokens' is list<", "string>; it needs a list of integer token ids", "data.column"]),
        ("list_of_float", lambda pa: pa.array([[0.5] * 9] * 10), 256,
         ["double>; it needs a list of integer token ids"]),
        ("bytes_small_vocab", lambda pa: pa.array([bytes(range(9))] * 10), 128,
         ["column 'tokens' is binary", "ids 0..255", "model.vocab_size=128", "raise model.vocab_size to 256"]),
        ("fixed_bytes_small_vocab", lambda pa: pa.array([bytes(range(9))] * 10, type=pa.binary(9)), 255,
         ["column 'tokens' is fixed_size_binary[9]", "model.vocab_size=255", "raise model.vocab_size to 256"]),
        ("null_bytes_row", lambda pa: pa.array([bytes(range(9))] * 6 + [None] + [bytes(range(9))] * 3), 256,
         ["row 6 of column 'tokens' is null"]),
        ("null_fixed_list_row", lambda pa: pa.array(_with(8, None), type=pa.list_(pa.int32(), 9)), 256,
         ["row 8 of column 'tokens' is null"]),
    ],
)
def test_token_columns_of_the_wrong_kind_are_named(tmp_path, case, array, vocab_size, must_mention):
    import pyarrow as pa

    path = _write_tokens(tmp_path / f"{case}.parquet", array(pa))
    with pytest.raises(ValueError) as err:
        data.check_dataset(path, "tokens", seq_len=8, global_batch=4, vocab_size=vocab_size)
    assert f"data.path='{path}'" in str(err.value)
    for text in must_mention:
        assert text in str(err.value), f"{text!r} missing from: {err.value}"


def test_good_token_columns_pass(tmp_path):
    import pyarrow as pa

    longer = [r + [18] * 3 for r in GOOD_ROWS]  # rows longer than seq_len + 1 are fine (cut when read)
    good = {
        "list": (pa.array(GOOD_ROWS, type=pa.list_(pa.int64())), 18),  # the largest id is 17: vocab 18 is enough
        "ragged_but_long_enough": (pa.array(longer[:5] + GOOD_ROWS[5:], type=pa.list_(pa.int64())), 19),
        "large_list_uint16": (pa.array(GOOD_ROWS, type=pa.large_list(pa.uint16())), 18),
        "fixed_list": (pa.array(GOOD_ROWS, type=pa.list_(pa.int32(), 9)), 18),
        "binary": (pa.array([bytes(range(250, 256)) + b"abc"] * 10), 256),
        "fixed_binary": (pa.array([bytes(range(9))] * 10, type=pa.binary(9)), 256),
    }
    for name, (array, vocab_size) in good.items():
        for statistics in (True, False):
            path = _write_tokens(tmp_path / f"{name}-{statistics}.parquet", array, write_statistics=statistics)
            assert data.check_dataset(path, "tokens", seq_len=8, global_batch=4, vocab_size=vocab_size) == 10, name


def test_token_check_streams_a_file_of_many_row_groups(tmp_path, monkeypatch):
    # 200k rows of 9 to 12 ids in 4 row groups; the bad row is in the last one, so every group is checked.
    # Reading the whole column at once is forbidden: the check must stream (bounded memory).
    import pyarrow as pa

    n = 200_000
    rng = np.random.default_rng(0)
    lengths = rng.integers(9, 13, size=n)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    values = rng.integers(0, 1000, size=int(offsets[-1])).astype(np.int32)

    def write(name, vals, offs):
        column = pa.ListArray.from_arrays(pa.array(offs), pa.array(vals))
        return _write_tokens(tmp_path / name, column, row_group_size=50_000)

    good = write("good.parquet", values, offsets)
    short = offsets.copy()
    short[n - 7 + 1:] -= lengths[n - 7] - 4  # row n-7 keeps only 4 ids
    too_large = values.copy()
    too_large[-3] = 5000
    short_path = write("short.parquet", values[: short[-1]], short)
    large_path = write("large.parquet", too_large, offsets)
    assert pq.ParquetFile(good).num_row_groups == 4

    def whole_file(*args, **kwargs):
        raise AssertionError("check_dataset read the whole file at once")

    monkeypatch.setattr(pq.ParquetFile, "read", whole_file)
    monkeypatch.setattr(pq.ParquetFile, "read_row_groups", whole_file)
    monkeypatch.setattr(pq, "read_table", whole_file)
    monkeypatch.setattr(token_checks, "SCAN_BATCH_ROWS", 3000)  # batches straddle the row groups of 50k
    assert data.check_dataset(good, "tokens", seq_len=8, global_batch=4, vocab_size=1000) == n
    with pytest.raises(ValueError, match=f"row {n - 7} has 4"):
        data.check_dataset(short_path, "tokens", seq_len=8, global_batch=4, vocab_size=1000)
    with pytest.raises(ValueError, match="token ids from 0 to 5000.*raise model.vocab_size to 5001"):
        data.check_dataset(large_path, "tokens", seq_len=8, global_batch=4, vocab_size=1000)


def test_prepare_checks_token_ids_against_model_vocab_size(tmp_path):
    import pyarrow as pa

    from raytrain.api import prepare

    path = _write_tokens(tmp_path / "ids.parquet", pa.array(_with(1, [300] * 9), type=pa.list_(pa.int64())))
    cfg = load_config(None, [f"data.path={path}", "model.seq_len=8", "train.global_batch=4",
                             f"run.dir={tmp_path / 'runs'}"])
    with pytest.raises(ValueError, match="token ids from 0 to 300.*model.vocab_size=256"):
        prepare(cfg)
    assert prepare(load_config(None, [f"data.path={path}", "model.seq_len=8", "train.global_batch=4",
                                      "model.vocab_size=301", f"run.dir={tmp_path / 'runs'}"])).num_samples == 10


def test_statistics_spare_the_scan_of_fixed_width_columns(tmp_path, monkeypatch, make_config):
    # A fixed row width and Parquet statistics (no nulls, min/max) answer every question: the built-in
    # corpus and a fixed-size list column are checked from the metadata alone, bad ids included.
    import pyarrow as pa

    corpus = data.resolve_data_path(make_config())
    fixed = _write_tokens(tmp_path / "fixed.parquet", pa.array(GOOD_ROWS, type=pa.list_(pa.int32(), 9)))
    bad = _write_tokens(tmp_path / "bad.parquet", pa.array(_with(6, [400] * 9), type=pa.list_(pa.int32(), 9)))
    no_stats = _write_tokens(tmp_path / "no_stats.parquet", pa.array(GOOD_ROWS, type=pa.list_(pa.int32(), 9)),
                             write_statistics=False)

    def scan(*args, **kwargs):
        raise AssertionError("scanned")

    monkeypatch.setattr(token_checks, "_scan_rows", scan)
    assert data.check_dataset(corpus, "tokens", seq_len=16, global_batch=4, vocab_size=256) > 100
    assert data.check_dataset(fixed, "tokens", seq_len=8, global_batch=4, vocab_size=18) == 10
    with pytest.raises(ValueError, match="token ids from 0 to 400"):
        data.check_dataset(bad, "tokens", seq_len=8, global_batch=4, vocab_size=256)
    with pytest.raises(AssertionError, match="scanned"):  # without statistics the rows must be read
        data.check_dataset(no_stats, "tokens", seq_len=8, global_batch=4, vocab_size=18)
