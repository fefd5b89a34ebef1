"""Sample order and exactly-once consumption (DESIGN invariant 5)."""

import os

import numpy as np
import pyarrow.parquet as pq
import pytest

from raytrain import data, train
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
        data.check_dataset(path, "tokens", seq_len=16, global_batch=4)
    with pytest.raises(ValueError, match="no column 'ids'"):
        data.check_dataset(path, "ids", seq_len=4, global_batch=4)
    with pytest.raises(ValueError, match="fewer than train.global_batch"):
        data.check_dataset(path, "tokens", seq_len=4, global_batch=64)
    not_parquet = tmp_path / "x.parquet"
    not_parquet.write_text("hello")
    with pytest.raises(ValueError, match="not a readable Parquet file"):
        data.check_dataset(str(not_parquet), "tokens", seq_len=4, global_batch=4)


@pytest.mark.parametrize("dp", [1, 2, 3])
def test_every_sample_exactly_once_per_epoch(ray_session, make_config, tmp_path, dp):
    num_samples, B = 48, 6
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
        assert data.check_dataset(path, "tokens", seq_len=8, global_batch=4) == 12
        with pytest.raises(ValueError, match=f"{kind}.parquet.*need >= model.seq_len \\+ 1 = 10 tokens, the first has 9"):
            data.check_dataset(path, "tokens", seq_len=9, global_batch=4)
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
        data.check_dataset(path, "tokens", seq_len=4, global_batch=4)


def test_workers_decode_once_per_machine_and_map_the_same_file(tmp_path):
    # With a cache_dir (as workers read), the rows are decoded once into a .npy that every later
    # reader memory-maps; a rewritten dataset gets a new cache; the tokens are the same either way.
    from concurrent.futures import ProcessPoolExecutor

    from raytrain import token_cache

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
