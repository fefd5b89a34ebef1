"""A checkpoint is data, checked before it is trusted: each file's size and
sha256 are recorded in the manifest as it is streamed out and verified on every load; a resumed
checkpoint is checked in ``prepare``, before any actor starts; a shard that would run code is
refused without repeating torch's advice to load it unsafely; old manifests (formats 1 and 2,
sizes only) still load."""

import hashlib
import io
import json
import os
import pickle
import subprocess
import sys

import pytest
import torch

from raytrain import checkpoint, train
from raytrain.api import prepare
from raytrain.checkpoint import verification


class _RunsCode:
    """A pickle that would run a shell command when loaded with weights_only=False."""

    def __init__(self, sentinel: str):
        self.sentinel = sentinel

    def __reduce__(self):
        return os.system, (f"touch {self.sentinel}",)


def _state(n: int = 4096) -> dict:
    return {"model": {"0.w": torch.arange(float(n))}, "optim": {}, "rng": torch.get_rng_state()}


def _publish(d: str, step: int = 1, shards=None) -> str:
    """A checkpoint of ``shards`` (stage -> state) written as a run writes one."""
    entries = [checkpoint.save_shard(d, stage, state) for stage, state in (shards or {0: _state()}).items()]
    checkpoint.publish(d, {"step": step, "shards": entries})
    return d


def _manifest(d: str) -> dict:
    with open(os.path.join(d, checkpoint.MANIFEST)) as f:
        return json.load(f)


def _rewrite_manifest(d: str, **changes) -> None:
    """What someone who can write the directory does: change the manifest to agree with new files, and its
    own checksum with it (checksums catch damage, not tampering)."""
    from raytrain.checkpoint.format import SELF_CHECKSUM, manifest_digest

    manifest = {**_manifest(d), **changes}
    with open(os.path.join(d, checkpoint.MANIFEST), "w") as f:
        json.dump({**manifest, SELF_CHECKSUM: manifest_digest(manifest)}, f)


def _entry(d: str, name: str) -> dict:
    """A manifest entry that agrees with the file ``name`` as it is now."""
    with open(os.path.join(d, name), "rb") as f:
        data = f.read()
    return {"file": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _flip(path: str, n: int = 64) -> None:
    """Flip ``n`` bytes in the middle of a file (inside the tensor data), its size unchanged."""
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 2)
        chunk = f.read(n)
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in chunk))
    assert os.path.getsize(path) == size


def _resume(make_config, d: str):
    return prepare(make_config("train.steps=5", f"checkpoint.resume={d}"))


# --- the manifest records what was written ---------------------------------------------------------


def test_save_shard_streams_the_file_and_records_its_size_and_sha256(tmp_path):
    d = _publish(str(tmp_path / "step_00000001"))
    manifest = _manifest(d)
    assert manifest["format"] == checkpoint.FORMAT_VERSION == 5
    assert manifest["shards"] == [_entry(d, "stage-0.pt")]
    assert torch.equal(checkpoint.load_state_dict(d)["0.w"], _state()["model"]["0.w"])


# --- flipped bytes (same size) ---------------------------------------------------------------------


def test_flipped_bytes_are_refused_on_load_naming_the_file(tmp_path):
    d = _publish(str(tmp_path / "step_00000001"))
    _flip(os.path.join(d, "stage-0.pt"))
    with pytest.raises(checkpoint.CheckpointError, match=r"stage-0\.pt does not match the sha256"):
        checkpoint.load_state_dict(d)
    with pytest.raises(checkpoint.CheckpointError, match=r"stage-0\.pt"):
        list(checkpoint.iter_shards(d))


def test_flipped_bytes_are_refused_in_prepare_before_any_actor(make_config, tmp_path):
    d = _publish(str(tmp_path / "step_00000001"), shards={0: _state(), 1: _state(64)})
    _flip(os.path.join(d, "stage-1.pt"), n=16)
    with pytest.raises(ValueError, match=r"checkpoint.resume=.*stage-1\.pt does not match the sha256"):
        _resume(make_config, d)


def test_the_stream_path_for_uris_verifies_too(tmp_path, monkeypatch):
    """Object-store URIs are not memory-mapped: they are hashed as a stream and loaded from a random-access
    file; forced here on a local directory."""
    d = _publish(str(tmp_path / "step_00000001"))
    monkeypatch.setattr(verification, "_local_path", lambda fs, path: None)
    assert torch.equal(checkpoint.load_state_dict(d)["0.w"], _state()["model"]["0.w"])
    checkpoint.verify(d)
    _flip(os.path.join(d, "stage-0.pt"))
    with pytest.raises(checkpoint.CheckpointError, match=r"stage-0\.pt does not match the sha256"):
        checkpoint.verify(d)


# --- a shard that would run code --------------------------------------------------------------------


@pytest.mark.parametrize("how", ["torch.save", "pickle.dumps"])
def test_a_shard_that_would_run_code_is_refused_without_suggesting_weights_only_false(make_config, tmp_path, how):
    sentinel = str(tmp_path / "ran")
    d = _publish(str(tmp_path / "step_00000001"))
    evil = {"model": {"0.w": _RunsCode(sentinel)}, "optim": {}}
    with open(os.path.join(d, "stage-0.pt"), "wb") as f:
        if how == "torch.save":  # a real torch zip archive whose pickle names os.system
            torch.save(evil, f)
        else:
            f.write(pickle.dumps(evil))
    _rewrite_manifest(d, shards=[_entry(d, "stage-0.pt")])  # the manifest agrees: only the load can refuse it
    for load in (checkpoint.load_state_dict, checkpoint.verify, lambda d: _resume(make_config, d)):
        with pytest.raises(ValueError) as err:
            load(d)
        message = str(err.value)
        assert os.path.join(d, "stage-0.pt") in message and "refused" in message, message
        assert "not a raytrain checkpoint" in message, message
        assert "weights_only" not in message and "add_safe_globals" not in message, message
        assert err.value.__cause__ is None or "weights_only" not in str(err.value.__cause__)
    assert not os.path.exists(sentinel)


# --- missing, truncated, a manifest that does not agree ---------------------------------------------


def test_a_missing_or_truncated_shard_is_refused_in_prepare(make_config, tmp_path):
    d = _publish(str(tmp_path / "step_00000001"), shards={0: _state(), 1: _state()})
    shard = os.path.join(d, "stage-1.pt")
    size = os.path.getsize(shard)
    with open(shard, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(ValueError, match=rf"stage-1\.pt has {size - 100} bytes, the manifest says {size}"):
        _resume(make_config, d)
    os.remove(shard)
    with pytest.raises(ValueError, match=r"stage-1\.pt is missing"):
        _resume(make_config, d)


@pytest.mark.parametrize("text, says", [
    (b"{not json", "not valid JSON"),
    (b"\xff\xfe\x00\x01binary", "not valid JSON"),
    (b"[1, 2]", "not a JSON object"),
    (b'{"format": 2, "seq": 1, "step": 1}', "lacks"),
    (b'{"format": 3, "seq": 1, "step": 1, "shards": [{"file": "stage-0.pt", "bytes": 1}]}', "sha256"),
    (b'{"format": 2, "seq": 1, "step": 1, "shards": [{"file": "../x.pt", "bytes": 1}]}', "../x.pt"),
    (b'{"format": 2, "seq": 1, "shards": [{"file": "stage-0.pt", "bytes": 1}]}', "lacks"),
])
def test_a_manifest_that_is_not_json_or_lacks_fields_is_refused(make_config, tmp_path, text, says):
    d = _publish(str(tmp_path / "step_00000001"))
    with open(os.path.join(d, checkpoint.MANIFEST), "wb") as f:
        f.write(text)
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.load_state_dict(d)
    assert checkpoint.MANIFEST in str(err.value) and says in str(err.value), err.value
    with pytest.raises(ValueError, match="checkpoint.resume=") as err:
        _resume(make_config, d)
    assert says in str(err.value), err.value


def test_a_manifest_that_misses_a_shard_of_a_sharded_stage_is_refused_in_prepare(make_config, tmp_path):
    """Every listed file may be intact and the checkpoint still incomplete: its rows must tile each tensor."""
    d = str(tmp_path / "step_00000001")
    full = torch.arange(8.0)
    entries = [checkpoint.save_shard(d, 0, {"model": {"0.w": full[4 * f:4 * f + 4]}, "optim": {},
                                            "rows": {"0.w": [4 * f, 4 * f + 4, 8]}}, f) for f in (0, 1)]
    checkpoint.publish(d, {"step": 1, "shards": entries[:1]})
    with pytest.raises(ValueError, match="do not cover"):
        _resume(make_config, d)


# --- old formats ------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", [1, 2])
def test_an_old_checkpoint_without_checksums_still_loads_and_its_sizes_are_checked(make_config, tmp_path, fmt):
    """Formats 1 and 2, written as their writers did (torch.save into memory, sizes only)."""
    d = tmp_path / "step_00000001"
    d.mkdir()
    buf = io.BytesIO()
    torch.save(_state(), buf)
    (d / "stage-0.pt").write_bytes(buf.getvalue())
    (d / checkpoint.MANIFEST).write_text(json.dumps({"format": fmt, "seq": 1, "step": 1, "shards": [
        {"file": "stage-0.pt", "bytes": len(buf.getvalue()), "finite": True}]}))
    assert torch.equal(checkpoint.load_state_dict(str(d))["0.w"], _state()["model"]["0.w"])
    assert _resume(make_config, str(d)).resume == str(d)
    with open(d / "stage-0.pt", "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match=r"stage-0\.pt has 100 bytes"):
        _resume(make_config, str(d))


# --- the CLI -----------------------------------------------------------------------------------------


def test_the_cli_refuses_a_corrupt_checkpoint_with_exit_2_and_one_line(tmp_path, data_cache):
    d = _publish(str(tmp_path / "ckpts" / "step_00000001"))
    _flip(os.path.join(d, "stage-0.pt"))
    sets = ["model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.seq_len=8", "train.steps=3",
            f"data.cache_dir={data_cache}", "data.max_bytes=100000", f"run.dir={tmp_path / 'runs'}",
            "run.trace_steps=0", "resources.placement_wait_s=20", f"checkpoint.resume={d}"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-m", "raytrain", "train", *[a for s in sets for a in ("--set", s)]],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120, env=env)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert os.path.join(d, "stage-0.pt") in lines[0] and "sha256" in lines[0], lines[0]


# --- end to end ----------------------------------------------------------------------------------------


def test_a_run_records_checksums_and_resumes_from_them(ray_session, make_config, tmp_path):
    ckpt_dir = str(tmp_path / "ckpts")
    first = train(make_config("parallel.pp=2", "train.steps=3", f"checkpoint.dir={ckpt_dir}"))
    manifest = _manifest(first.checkpoint)
    assert manifest["format"] == 5 and len(manifest["shards"]) == 2
    for entry in manifest["shards"]:
        assert {k: entry[k] for k in ("file", "bytes", "sha256")} == _entry(first.checkpoint, entry["file"])
    resumed = train(make_config("parallel.pp=2", "train.steps=5", f"checkpoint.dir={ckpt_dir}",
                                "checkpoint.resume=latest"))
    assert [r["step"] for r in resumed.metrics] == [4, 5]
    assert all("sha256" in e for e in _manifest(resumed.checkpoint)["shards"])


# --- a manifest that disagrees with itself or its directory -----------------------------------------------


def _edit(d: str, **changes) -> None:
    """A hand edit that leaves the manifest's own checksum as it was."""
    manifest = {**_manifest(d), **changes}
    with open(os.path.join(d, checkpoint.MANIFEST), "w") as f:
        json.dump(manifest, f)


def test_a_manifest_edited_by_hand_no_longer_matches_its_own_checksum(tmp_path):
    d = _publish(str(tmp_path / "step_00000001"))
    _edit(d, step=7)
    with pytest.raises(checkpoint.CheckpointError, match=r"manifest.json does not match its own manifest_sha256"):
        checkpoint.verify(d)


@pytest.mark.parametrize("changes, words", [
    ({"step": 2}, "its step 2 is not its directory's 1"),
    ({"samples_seen": 9, "config": {"train": {"global_batch": 8}}}, r"samples_seen=9 is not step 1 x train.global_batch=8"),
    ({"layout": {"pp": 2, "fsdp": 1, "tp": 1, "stage_layers": [[[0]]]}}, "its layout has pp=2 but 1 stages of layers"),
    ({"layout": {"pp": 2, "fsdp": 1, "tp": 1, "stage_layers": [[[0]], [[0]]]}}, "its stages' layers are not each of the model's layers once"),
    ({"layout": {"pp": 1, "fsdp": 1, "tp": 1, "stage_layers": [[[0]]]}, "config": {"parallel": {"pp": 2}}},
     r"its layout has pp=1, its config parallel.pp=2"),
], ids=["step", "samples", "stages", "layers", "config"])
def test_a_manifest_whose_fields_contradict_each_other_is_refused_by_name(tmp_path, changes, words):
    d = _publish(str(tmp_path / "step_00000001"))
    _rewrite_manifest(d, **changes)  # its own checksum recomputed: only the consistency check can refuse it
    with pytest.raises(checkpoint.CheckpointError, match=rf"manifest.json contradicts itself: {words}"):
        checkpoint.verify(d)


# --- a save that cannot be written -------------------------------------------------------------------


def test_a_full_disk_is_named_with_the_file_and_enospc_not_torchs_internal_assertion(tmp_path, monkeypatch):
    import errno

    from raytrain.checkpoint import storage

    class FullDisk:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    real = storage.filesystem

    def full(uri):
        fs, path = real(uri)
        wrapped = type("Fs", (), {"create_dir": lambda self, *a, **k: fs.create_dir(*a, **k),
                                  "open_output_stream": lambda self, p: FullDisk()})()
        return wrapped, path

    monkeypatch.setattr(storage, "filesystem", full)
    d = str(tmp_path / "step_00000001")
    with pytest.raises(checkpoint.CheckpointWriteError) as err:
        checkpoint.save_shard(d, 0, _state())
    assert str(err.value) == (f"cannot write checkpoint file {d}/stage-0.pt: no space left on device (ENOSPC): free "
                              "space there, or point checkpoint.dir at another filesystem")


def test_a_save_that_fails_names_the_last_good_checkpoint(tmp_path):
    from raytrain.control.ledger import Ledger
    from raytrain.control.protocol import StepFailed
    from raytrain.control.saving import Checkpoints
    from tests.helpers import fake_config

    class FailingSaves:
        def save(self, members, ckpt_dir):
            raise StepFailed("a worker of stage 0 failed in save: CheckpointWriteError: cannot write ... (ENOSPC)")

    cfg = fake_config(tmp_path)
    saves = Checkpoints(FailingSaves(), Ledger(last_checkpoint="/ckpt/step_00000004"), cfg, [[[0]]])
    with pytest.raises(StepFailed, match=r"\(ENOSPC\); the last good checkpoint is /ckpt/step_00000004: resume from it"):
        saves.save([], 6, cfg.layout().mesh)
