"""A model.hf directory is data: its Python never runs unasked (auto_map), it must be a decoder-only
causal LM, and unreadable weights are named; all refused by ``prepare`` before any actor starts."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

import torch

from raytrain import checkpoint
from raytrain.config import load_config
from raytrain.driver.prepare import prepare
from raytrain.models.hf_weights import build_hf_stage, hf_layers
from tests.hf_models import write_hf_model

CUSTOM_CODE = '''import pathlib
pathlib.Path({sentinel!r}).write_text("the directory's code ran")
from transformers import LlamaConfig, LlamaForCausalLM


class CustomConfig(LlamaConfig):
    model_type = "custom_llama"


class CustomForCausalLM(LlamaForCausalLM):
    config_class = CustomConfig
'''


def custom_code_dir(tmp_path, known_type: bool) -> tuple[str, str]:
    """A directory whose config.json names its own Python file in auto_map; the file writes a sentinel
    when imported. ``known_type``: model_type llama, so transformers could build it without the code
    (and would silently); else a model type only the code defines. Returns (directory, sentinel).
    The directory's name is unique, as transformers caches the imported code under it."""
    path = tmp_path / f"custom-{tmp_path.name}"
    sentinel = str(tmp_path / "SENTINEL")
    write_hf_model(path, "llama", weights=False)
    (path / "custom_model.py").write_text(CUSTOM_CODE.format(sentinel=sentinel))
    config = json.loads((path / "config.json").read_text())
    auto_map = {"AutoModelForCausalLM": "custom_model.CustomForCausalLM"}
    if not known_type:
        config.update(model_type="custom_llama", architectures=["CustomForCausalLM"])
        auto_map["AutoConfig"] = "custom_model.CustomConfig"
    (path / "config.json").write_text(json.dumps({**config, "auto_map": auto_map}))
    return str(path), sentinel


def prepared_for(tmp_path, path, *overrides):
    return prepare(load_config(None, [f"model.hf={path}", f"run.dir={tmp_path}/runs", "model.seq_len=16", *overrides]))


@pytest.mark.parametrize("known_type", [False, True], ids=["custom-model-type", "llama-with-auto-map"])
def test_a_directory_naming_custom_code_is_refused_naming_its_config_json(tmp_path, known_type):
    path, sentinel = custom_code_dir(tmp_path, known_type)
    with pytest.raises(ValueError) as err:
        prepared_for(tmp_path, path)
    message = str(err.value)
    assert f"{path}/config.json" in message and "auto_map" in message and "custom_model" in message, message
    assert "model.trust_remote_code=true" in message and "\n" not in message, message
    assert not os.path.exists(sentinel)


@pytest.mark.parametrize("known_type", [False, True], ids=["custom-model-type", "llama-with-auto-map"])
def test_the_workers_and_the_export_refuse_it_too(tmp_path, known_type):
    """Not only prepare: what workers (build_hf_stage) and export (hf_layers, export_hf) load refuses it."""
    from raytrain.models.export import export_hf

    path, sentinel = custom_code_dir(tmp_path, known_type)
    with pytest.raises(ValueError, match="config.json names custom Python code in auto_map"):
        build_hf_stage(path, "layers", 0, [0])
    with pytest.raises(ValueError, match="config.json names custom Python code in auto_map"):
        hf_layers(path, "whole")
    step = checkpoint.step_dir(str(tmp_path / "ckpt"), 1)  # a run of this directory, as export finds it
    cfg = load_config(None, [f"model.hf={path}"])
    os.makedirs(step)
    checkpoint.publish(step, {"step": 1, "shards": [], "config": cfg.to_dict()})
    with pytest.raises(ValueError, match="config.json names custom Python code in auto_map"):
        export_hf(step, str(tmp_path / "out"))
    assert not os.path.exists(sentinel) and not os.path.exists(tmp_path / "out")


def test_a_checkpoint_cannot_turn_custom_code_on_for_export(tmp_path):
    """A manifest is data: one that says model.trust_remote_code=true (a checkpoint from someone else)
    does not make ``raytrain export`` run the directory's code; only the user's --trust-remote-code does."""
    from raytrain.models.export import export_hf

    path, sentinel = custom_code_dir(tmp_path, known_type=False)
    step = checkpoint.step_dir(str(tmp_path / "ckpt"), 1)
    cfg = load_config(None, [f"model.hf={path}", "model.trust_remote_code=true"])
    os.makedirs(step)
    checkpoint.publish(step, {"step": 1, "shards": [], "config": cfg.to_dict()})
    with pytest.raises(ValueError, match="config.json names custom Python code in auto_map"):
        export_hf(step, str(tmp_path / "out"))
    assert not os.path.exists(sentinel)


def test_model_trust_remote_code_true_is_passed_to_transformers(tmp_path):
    """The opt-in works: the directory's own classes build the model (its code runs, as asked)."""
    path, sentinel = custom_code_dir(tmp_path, known_type=False)
    prepared = prepared_for(tmp_path, path, "model.trust_remote_code=true")
    assert prepared.cfg.model.n_layer == 2 and os.path.exists(sentinel)
    model, _ = hf_layers(path, "layers", trust_remote_code=True)
    assert type(model).__name__ == "CustomForCausalLM"


def _cli(tmp_path, path, stdin_text):
    """``python -m raytrain train`` on model.hf=``path``, its stdin closed or holding ``stdin_text``."""
    command = [sys.executable, "-m", "raytrain", "train", "--set", f"model.hf={path}", "--set",
               f"run.dir={tmp_path}/runs", "--set", "model.seq_len=16", "--set", "train.steps=1"]
    stdin = subprocess.DEVNULL if stdin_text is None else None
    return subprocess.run(command, stdin=stdin, input=stdin_text, capture_output=True, text=True, timeout=180,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


@pytest.mark.parametrize("stdin_text", [None, "y\ny\n"], ids=["stdin-closed", "stdin-says-yes"])
def test_the_cli_exits_2_in_one_line_and_the_code_never_runs(tmp_path, stdin_text):
    """Even a 'y' waiting on stdin (transformers' prompt) runs nothing: nothing asks."""
    path, sentinel = custom_code_dir(tmp_path, known_type=False)
    done = _cli(tmp_path, path, stdin_text)
    assert done.returncode == 2, done.stderr
    line = _one_line(done.stderr)
    assert f"{path}/config.json" in line and "auto_map" in line and "model.trust_remote_code=true" in line, line
    assert "Do you wish" not in done.stdout + done.stderr
    assert not os.path.exists(sentinel)


def test_a_tokenizer_directory_runs_no_code(tmp_path):
    """data.tokenizer is read by the tokenizers library from tokenizer.json alone (no Python hooks can be
    deserialised); a tokenizer_config.json naming custom code is never read, so it is not refused."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from raytrain.data.text import load_tokenizer, tokenizer_file

    sentinel = tmp_path / "SENTINEL"
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenization_custom.py").write_text(f"open({str(sentinel)!r}, 'w').write('ran')\n")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"auto_map": {"AutoTokenizer": ["tokenization_custom.CustomTokenizer", None]}}))
    assert load_tokenizer(tokenizer_file(str(tmp_path))).encode("hello").ids == [1]
    assert not sentinel.exists()


def _save(model_or_config, path) -> str:
    torch.manual_seed(0)
    model_or_config.save_pretrained(path)
    return str(path)


def _not_causal_dirs(tmp_path) -> dict:
    """One directory per kind of model that is not a decoder-only causal LM (tiny configs)."""
    import transformers as T

    bert = dict(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                max_position_embeddings=64)
    roberta = T.RobertaConfig(**bert, architectures=["RobertaForCausalLM"])  # named a causal LM, is_decoder false
    return {
        "bert-config": (_save(T.BertConfig(**bert), tmp_path / "bert"), "model_type 'bert'"),
        "bert-masked-lm": (_save(T.BertForMaskedLM(T.BertConfig(**bert)), tmp_path / "mlm"), "BertForMaskedLM"),
        "roberta-for-causal-lm": (_save(roberta, tmp_path / "roberta"), "RobertaForCausalLM"),
        "t5": (_save(T.T5Config(vocab_size=256, d_model=32, d_ff=64, num_layers=1, num_heads=4, d_kv=8),
                     tmp_path / "t5"), "encoder-decoder"),
        "vit": (_save(T.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64),
                      tmp_path / "vit"), "model_type 'vit'"),
        "vit-classifier": (_save(T.ViTForImageClassification(T.ViTConfig(
            hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64)), tmp_path / "vitc"),
            "ViTForImageClassification"),
    }


KINDS = ["bert-config", "bert-masked-lm", "roberta-for-causal-lm", "t5", "vit", "vit-classifier"]


@pytest.mark.parametrize("cut", ["auto", "whole"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_model_that_is_not_a_decoder_only_causal_lm_is_refused_naming_what_it_is(tmp_path, kind, cut):
    path, what = _not_causal_dirs(tmp_path)[kind]
    with pytest.raises(ValueError) as err:
        prepared_for(tmp_path, path, f"model.hf_cut={cut}")
    message = str(err.value)
    assert f"model.hf={path!r}" in message and what in message and "decoder-only causal LM" in message, message
    assert "\n" not in message
    if kind in ("bert-config", "roberta-for-causal-lm"):
        assert "attention is not causal" in message and "is_decoder" in message, message


def test_a_bert_made_a_causal_decoder_is_accepted(tmp_path):
    """is_decoder true gives BERT a causal mask: a real causal LM, which trains whole."""
    import transformers as T

    config = T.BertConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=64, max_position_embeddings=64, is_decoder=True)
    assert prepared_for(tmp_path, _save(config, tmp_path / "bert")).cfg.model.hf_cut == "whole"


def _broken_single(path, how: str) -> str:
    file = path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes({"truncated": data[: len(data) // 2], "last-bytes-cut": data[:-8],
                      "random-bytes": os.urandom(len(data)), "empty": b""}[how])
    return str(file)


@pytest.mark.parametrize("how", ["truncated", "last-bytes-cut", "random-bytes", "empty"])
def test_an_unreadable_model_safetensors_is_named(tmp_path, how):
    path = write_hf_model(tmp_path / "model", "llama")
    file = _broken_single(tmp_path / "model", how)
    with pytest.raises(ValueError) as err:
        prepared_for(tmp_path, path)
    assert f"{file} is not a readable safetensors file" in str(err.value) and "\n" not in str(err.value)


def _sharded(tmp_path) -> str:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(write_hf_model(tmp_path / "one", "llama"))
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    return str(tmp_path / "sharded")


@pytest.mark.parametrize("how", ["shard-truncated", "shard-missing", "index-not-json", "shard-lacks-a-tensor"])
def test_a_broken_sharded_checkpoint_is_named(tmp_path, how):
    path = _sharded(tmp_path)
    index = os.path.join(path, "model.safetensors.index.json")
    weight_map = json.load(open(index))["weight_map"]
    shard = os.path.join(path, sorted(set(weight_map.values()))[-1])
    named = shard
    if how == "shard-truncated":
        open(shard, "r+b").truncate(os.path.getsize(shard) // 2)
    elif how == "shard-missing":
        os.remove(shard)
    elif how == "index-not-json":
        open(index, "w").write("{not json")
        named = index
    else:  # the index places a tensor in a shard that does not hold it
        first = os.path.join(path, sorted(set(weight_map.values()))[0])
        weight_map[next(k for k, v in weight_map.items() if os.path.join(path, v) == first)] = os.path.basename(shard)
        json.dump({"metadata": {}, "weight_map": weight_map}, open(index, "w"))
    with pytest.raises(ValueError) as err:
        prepared_for(tmp_path, path)
    assert named in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_the_cli_names_a_truncated_model_safetensors_in_one_line(tmp_path):
    path = write_hf_model(tmp_path / "model", "llama")
    file = _broken_single(tmp_path / "model", "truncated")
    done = _cli(tmp_path, path, None)
    assert done.returncode == 2, done.stderr
    assert file in _one_line(done.stderr)


def test_an_unparseable_config_json_is_named(tmp_path):
    write_hf_model(tmp_path / "model", "llama", weights=False)
    (tmp_path / "model" / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(ValueError, match=r"config.json is not a readable JSON config"):
        prepared_for(tmp_path, tmp_path / "model")

