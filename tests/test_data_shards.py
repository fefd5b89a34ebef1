"""Data in many files (raytrain.data.shards): data.path as a directory, a glob or a list, local or a
pyarrow.fs URI; the sample order over the files is the order over their concatenation; each file is
decoded on a machine only when the order first reaches it; a bad file is named before any actor starts."""

import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from raytrain import checkpoint, data, train
from raytrain.config import load_config
from raytrain.data import shards, token_checks
from raytrain.data.shards import Files
from raytrain.driver.prepare import prepare

SEQ_LEN = 8
WIDTH = SEQ_LEN + 1


def token_rows(count: int, seed: int = 0) -> list[np.ndarray]:
    """Rows of 1 to 3 windows of WIDTH ids plus a tail of 0..WIDTH-1 unused ones: a row's windows and
    its dropped tail must land the same whether the row sits in one file or in a shard."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=int(rng.integers(1, 4)) * WIDTH + int(rng.integers(0, WIDTH)))
            for _ in range(count)]


def write_rows(path, rows: list[np.ndarray], column: str = "tokens") -> str:
    pq.write_table(pa.table({column: pa.array([r.tolist() for r in rows], type=pa.list_(pa.int64()))}), str(path))
    return str(path)


def write_shards(where, rows: list[np.ndarray], cuts: list[int]) -> list[str]:
    """rows[cuts[i]:cuts[i + 1]] as shard i; named so that sorted order is the rows' order."""
    os.makedirs(where, exist_ok=True)
    bounds = [0, *cuts, len(rows)]
    return [write_rows(os.path.join(where, f"part-{i:05d}.parquet"), rows[a:b])
            for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]


def config(tmp_path, path, *overrides: str):
    return load_config(None, [
        f"data.path={path}", f"model.seq_len={SEQ_LEN}", "model.n_layer=2", "model.d_model=32", "model.n_head=2",
        "train.global_batch=4", "train.steps=2", "train.seed=5", f"data.cache_dir={tmp_path / 'cache'}",
        f"run.dir={tmp_path / 'runs'}", "run.trace_steps=0", "resources.placement_wait_s=20",
        "resources.step_timeout_s=60", *overrides])


def decoded(cache_dir) -> set[str]:
    """The source file names whose rows this cache holds (token_cache: <name>-<digest>.npy)."""
    where = os.path.join(cache_dir, "decoded")
    names = os.listdir(where) if os.path.isdir(where) else []
    return {n.rsplit("-", 1)[0] for n in names if n.endswith(".npy")}


# --- resolving the forms ----------------------------------------------------------------------------


def test_directory_glob_and_list_resolve_to_the_same_sorted_files(tmp_path, monkeypatch):
    where = tmp_path / "corpus"
    paths = write_shards(where, token_rows(9), [3, 6])
    (where / "_SUCCESS").write_text("")  # a writer's marker and a hidden checksum: skipped, as pyarrow.dataset does
    (where / ".part-00000.parquet.crc").write_text("x")
    (where / "_temporary").mkdir()
    write_rows(where / "_temporary" / "part-99999.parquet", token_rows(1))
    forms = [str(where), f"{where}/*.parquet", f"{where}/part-*", [paths[2], paths[0], paths[1]],
             [f"{where}/part-0000[01].parquet", paths[2]], f"{tmp_path}/**/part-*.parquet"]
    for form in forms:
        assert shards.resolve(form) == paths, form
    monkeypatch.chdir(tmp_path)  # relative entries give relative paths, as a single relative data.path always did
    relative = [os.path.relpath(p, tmp_path) for p in paths]
    assert shards.resolve("corpus") == shards.resolve("./corpus/*.parquet") == relative == sorted(relative)
    assert shards.resolve("corpus/part-00001.parquet") == ["corpus/part-00001.parquet"]
    assert shards.resolve(f"file://{where}") == [f"file://{p}" for p in paths]
    assert shards.resolve(f"file://{where}/*.parquet") == [f"file://{p}" for p in paths]

    with pytest.raises(ValueError, match=r"data.path=.* names '.*part-00001.parquet' more than once"):
        shards.resolve([str(where), paths[1]])
    with pytest.raises(ValueError, match=r"data.eval_path=.*'.*\*.jsonl' names no data file"):
        shards.resolve(f"{where}/*.jsonl", "data.eval_path")
    with pytest.raises(ValueError, match=r"data.path=.*missing.*: no such file or directory"):
        shards.resolve([paths[0], str(tmp_path / "missing")])


def test_data_path_takes_a_list_from_an_override_or_a_file(tmp_path):
    listed = load_config(None, ["data.path=[/d/b.parquet, /d/a.parquet]"])
    assert listed.data.path == ["/d/b.parquet", "/d/a.parquet"]
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("data:\n  path:\n    - s3://bucket/a.parquet\n  eval_path: /d/held/\n")
    from_file = load_config(str(yaml_file), [])
    assert from_file.data.path == ["s3://bucket/a.parquet"] and from_file.data.eval_path == "/d/held/"
    for bad, fix in [("data.path=[]", "a list of those"), ("data.path={a: 1}", "expects a string or a list"),
                     ("data.eval_path=[a.parquet, '']", "a list of those")]:
        with pytest.raises(ValueError, match=fix):
            load_config(None, [bad])


# --- the order over many files -----------------------------------------------------------------------


@pytest.mark.parametrize("form", ["directory", "glob", "list", "file URI"])
def test_the_order_over_shards_is_the_order_over_one_file_of_the_same_tokens(tmp_path, form):
    rows = token_rows(40, seed=1)
    one = write_rows(tmp_path / "one.parquet", rows)
    paths = write_shards(tmp_path / "corpus", rows, [7, 8, 25])  # shards of 7, 1, 17 and 15 rows
    spec = {"directory": str(tmp_path / "corpus"), "glob": f"{tmp_path}/corpus/*.parquet",
            "list": "[" + ", ".join(reversed(paths)) + "]", "file URI": f"file://{tmp_path}/corpus"}[form]
    single, sharded = prepare(config(tmp_path, one)), prepare(config(tmp_path, spec))

    n = single.num_samples
    assert sharded.num_samples == n == sum(len(r) // WIDTH for r in rows)
    assert len(sharded.source.train.paths) == 4 and sum(sharded.source.train.samples) == n
    a, b = data.open_dataset(single.source.train, single.cfg), data.open_dataset(sharded.source.train, sharded.cfg)
    everything = list(range(n))
    assert [t.tolist() for t in a.batch(everything)] == [t.tolist() for t in b.batch(everything)]
    ids = data.sample_ids(5, n, 0, 3 * n)  # three epochs of the run's order, read through both
    assert all(torch.equal(x, y) for x, y in zip(a.batch(ids), b.batch(ids)))
    expected = np.concatenate([r[: len(r) // WIDTH * WIDTH].reshape(-1, WIDTH) for r in rows])
    assert b.batch([0, n - 1])[0].tolist() == expected[[0, n - 1], :SEQ_LEN].tolist()


def test_held_out_rows_come_from_the_last_shards_or_an_eval_directory(tmp_path):
    rows = token_rows(30, seed=2)
    one = write_rows(tmp_path / "one.parquet", rows)
    write_shards(tmp_path / "corpus", rows, [10, 20])
    single = prepare(config(tmp_path, one, "data.eval_fraction=0.25"))
    sharded = prepare(config(tmp_path, tmp_path / "corpus", "data.eval_fraction=0.25"))
    assert (sharded.num_samples, sharded.held_out) == (single.num_samples, single.held_out)
    files, first = data.held_out_source(sharded.cfg, sharded.source, sharded.num_samples)
    held = list(range(first, first + sharded.held_out))
    want = data.open_dataset(one, single.cfg).batch(held)
    assert all(torch.equal(x, y) for x, y in zip(data.open_dataset(files, sharded.cfg).batch(held), want))

    held_paths = write_shards(tmp_path / "held", token_rows(6, seed=3), [2])
    prepared = prepare(config(tmp_path, one, f"data.eval_path={tmp_path / 'held'}"))
    assert prepared.source.held_out.paths == tuple(held_paths) and prepared.held_out == prepared.source.held_out.total > 0


# --- lazily, file by file ----------------------------------------------------------------------------


def test_a_first_step_decodes_only_the_shards_it_reads(tmp_path):
    rows = token_rows(60, seed=4)
    write_shards(tmp_path / "corpus", rows, list(range(5, 60, 5)))  # 12 shards of 5 rows
    cache = tmp_path / "cache"
    prepared = prepare(config(tmp_path, tmp_path / "corpus"))
    assert decoded(cache) == set()  # prepare read footers and scanned columns; it decoded nothing into the cache
    files = prepared.source.train
    dataset = data.open_dataset(files, prepared.cfg)  # what a worker's join does: opens nothing yet
    assert decoded(cache) == set() and dataset.opened == {}

    step0 = data.sample_ids(prepared.cfg.train.seed, prepared.num_samples, 0, 4)
    needed = {shards.basename(files.paths[k]) for k in files.locate(np.array(step0)).tolist()}
    assert len(needed) < len(files.paths)  # a step of 4 samples out of 12 shards cannot need them all
    dataset.batch(step0)
    assert decoded(cache) == needed  # exactly the files step 0 reads, each decoded once into the cache
    assert {shards.basename(files.paths[k]) for k in dataset.opened} == needed

    dataset.batch(list(range(prepared.num_samples)))  # an epoch later, every file is there, still once each
    assert decoded(cache) == {shards.basename(p) for p in files.paths}
    assert len(os.listdir(cache / "decoded")) == 2 * len(files.paths)  # each .npy and its lock, no temporaries


def test_a_shard_rewritten_during_the_run_is_refused_not_shifted(tmp_path):
    paths = write_shards(tmp_path / "corpus", token_rows(10, seed=6), [5])
    prepared = prepare(config(tmp_path, tmp_path / "corpus"))
    rewritten = token_rows(3, seed=7)  # fewer samples than prepare counted
    write_rows(paths[0], rewritten)
    now, then = sum(len(r) // WIDTH for r in rewritten), prepared.source.train.samples[0]
    assert now != then
    dataset = data.open_dataset(prepared.source.train, prepared.cfg)
    with pytest.raises(ValueError, match=f"part-00000.parquet' holds {now} samples, not the {then} .* changed during"):
        dataset.batch([0])


# --- bad shards, before any actor --------------------------------------------------------------------


def _bad_shard(where, case: str) -> str:
    if case == "wrong column":
        return write_rows(where / "part-00001.parquet", token_rows(4), column="ids")
    if case == "wrong type":
        path = str(where / "part-00001.parquet")
        pq.write_table(pa.table({"tokens": pa.array([0.5, 1.5])}), path)
        return path
    if case == "corrupt":
        good = (where / "part-00000.parquet").read_bytes()
        path = where / "part-00001.parquet"
        path.write_bytes(good[: len(good) // 2])  # cut short: no footer
        return str(path)
    if case == "not parquet":
        path = where / "README.txt"
        path.write_text("shards written by job 17\n")
        return str(path)
    assert case == "empty"
    path = str(where / "part-00001.parquet")
    pq.write_table(pa.table({"tokens": pa.array([], type=pa.list_(pa.int64()))}), path)
    return path


@pytest.mark.parametrize("case, fix", [
    ("wrong column", "has no column 'tokens'"), ("wrong type", "column 'tokens' is double"),
    ("corrupt", "is not a readable Parquet file"), ("not parquet", "is not a readable Parquet file"),
    ("empty", "is empty: it holds no samples")])
def test_a_bad_shard_is_refused_by_prepare_naming_the_file(tmp_path, case, fix):
    where = tmp_path / "corpus"
    write_shards(where, token_rows(12, seed=8), [4, 8])
    (where / "part-00001.parquet").unlink()
    bad = _bad_shard(where, case)
    with pytest.raises(ValueError) as err:
        prepare(config(tmp_path, where))
    message = str(err.value)
    assert repr(bad) in message and fix in message, message
    assert f"one of the 3 files data.path='{where}' names: fix it or remove it from there" in message
    assert decoded(tmp_path / "cache") == set()


def test_the_cli_refuses_a_stray_file_in_the_data_directory_with_exit_2(tmp_path):
    where = tmp_path / "corpus"
    write_shards(where, token_rows(12, seed=9), [6])
    bad = _bad_shard(where, "not parquet")
    proc = subprocess.run([sys.executable, "-m", "raytrain", "train", "--set", f"data.path={where}",
                           "--set", f"model.seq_len={SEQ_LEN}", "--set", f"run.dir={tmp_path / 'runs'}",
                           "--set", f"data.cache_dir={tmp_path / 'cache'}"],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert repr(bad) in lines[0] and "not a readable Parquet file" in lines[0] and "remove it" in lines[0]
    assert "Started a local Ray instance" not in proc.stderr + proc.stdout


def test_shards_together_must_fill_a_global_batch(tmp_path):
    write_shards(tmp_path / "corpus", [np.arange(WIDTH)] * 3, [1, 2])  # three files, one sample each
    with pytest.raises(ValueError, match=r"its 3 files hold 3 samples \(of model.seq_len \+ 1 = 9 tokens\), "
                                         r"fewer than train.global_batch=4"):
        prepare(config(tmp_path, tmp_path / "corpus"))


# --- text shards ------------------------------------------------------------------------------------


def test_text_shards_pack_file_by_file(tmp_path):
    """Each text file is tokenised and packed on its own (its last partial row dropped), so the samples of
    shards are each file's packed rows in path order; prepare tokenises them to count them."""
    pytest.importorskip("tokenizers")
    from tests.test_text_data import VOCAB, make_documents, train_tokenizer, write_jsonl, write_parquet

    train_tokenizer(tmp_path / "tok")
    docs = make_documents(240)
    os.makedirs(tmp_path / "text")
    paths = [write_jsonl(tmp_path / "text" / "a.jsonl", docs[:100]),
             write_parquet(tmp_path / "text" / "b.parquet", docs[100:])]
    text = [f"data.text_column=text", f"data.tokenizer={tmp_path / 'tok'}", f"model.vocab_size={VOCAB}"]
    prepared = prepare(config(tmp_path, tmp_path / "text", *text))
    per_file = [len(data.open_dataset(p, prepared.cfg)) for p in paths]
    assert prepared.source.train.samples == tuple(per_file) and prepared.num_samples == sum(per_file)
    sharded = data.open_dataset(prepared.source.train, prepared.cfg)
    last = data.open_dataset(paths[1], prepared.cfg).batch([0, per_file[1] - 1])
    got = sharded.batch([per_file[0], prepared.num_samples - 1])
    assert all(torch.equal(x, y) for x, y in zip(got, last))


# --- end to end ---------------------------------------------------------------------------------------


def test_sharded_data_trains_to_the_same_parameters_as_one_file(ray_session, tmp_path):
    """dp=2 on 12 shards ends at exactly the parameters of dp=2 on one file of the same tokens, and the
    workers decoded only the shards the run's samples were in."""
    rows = token_rows(60, seed=10)
    one = write_rows(tmp_path / "one.parquet", rows)
    paths = write_shards(tmp_path / "corpus", rows, list(range(5, 60, 5)))
    common = ["parallel.dp=2", "train.steps=2", "run.record_samples=true"]
    single = train(config(tmp_path / "a", one, *common))
    sharded = train(config(tmp_path / "b", tmp_path / "corpus", *common))

    got, want = checkpoint.load_state_dict(sharded.checkpoint), checkpoint.load_state_dict(single.checkpoint)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert [r["loss"] for r in sharded.metrics] == [r["loss"] for r in single.metrics]
    seen = [i for r in sharded.metrics for i in r["sample_ids"]]
    files = prepare(config(tmp_path / "c", tmp_path / "corpus")).source.train
    read = {shards.basename(paths[k]) for k in files.locate(np.array(seen)).tolist()}
    assert decoded(tmp_path / "b" / "cache") == read and len(read) < len(paths)


def test_a_scan_is_remembered_per_file_version_and_ids_are_checked_again(tmp_path, monkeypatch):
    """Rows of any length need a pass over the column to count windows: done once per file version, so a
    second prepare (a resume, a sweep's next trial) reads footers only; the ids are still checked against
    each run's model.vocab_size."""
    paths = write_shards(tmp_path / "corpus", token_rows(12, seed=11), [6])
    scans = []
    real = token_checks._scan_rows
    monkeypatch.setattr(token_checks, "_scan_rows", lambda meta, source, *a: scans.append(source) or real(meta, source, *a))
    first = prepare(config(tmp_path, tmp_path / "corpus"))
    assert len(scans) == 2
    again = prepare(config(tmp_path, tmp_path / "corpus"))
    assert len(scans) == 2 and again.source == first.source  # nothing scanned the second time
    with pytest.raises(ValueError, match=r"part-00000.parquet.*token ids from \d+ to \d+, outside "
                                         r"\[0, model.vocab_size=100\)"):
        prepare(config(tmp_path, tmp_path / "corpus", "model.vocab_size=100"))
    assert len(scans) == 2
    write_rows(paths[1], token_rows(3, seed=12))  # a new version of one file is scanned afresh
    assert prepare(config(tmp_path, tmp_path / "corpus")).source.train.samples[1] == sum(
        len(r) // WIDTH for r in token_rows(3, seed=12))
    assert len(scans) == 3 and paths[1] in scans[-1]


def test_a_store_that_cannot_be_listed_is_named(monkeypatch):
    """A URI whose store refuses this machine (no credentials, unreachable) is one line naming it and the fix."""
    class Refusing:
        def get_file_info(self, _):
            raise PermissionError("AWS Error ACCESS_DENIED during HeadObject operation")

    monkeypatch.setattr(shards, "filesystem", lambda path, key="data.path": (Refusing(), path.split("://")[1]))
    with pytest.raises(ValueError, match=r"data.path='s3://corpus/shards/': cannot list .*ACCESS_DENIED.*credentials"):
        shards.resolve("s3://corpus/shards/")
