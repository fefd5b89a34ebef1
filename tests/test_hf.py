"""Hugging Face causal LMs (model.hf): cut generically, every layout ends where one process does,
pretrained weights in, exported weights out bit for bit."""

import pytest

pytest.importorskip("transformers")

import torch
from torch import nn

from raytrain import checkpoint, train
from raytrain.config import load_config
from raytrain.driver.prepare import prepare
from raytrain.models.hf_conversion import to_file_names
from raytrain.models.hf_model import meta_model
from raytrain.models.hf_weights import build_hf_stage
from tests.forked_stages import run_stages
from tests.hf_models import FAMILIES, assert_same_hf_params, write_hf_model
from tests.helpers import LONG_RUN_LR, assert_same_params, reference_state


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """Pretrained (random) weights per family, untied so that every layout can cut them."""
    return {f: write_hf_model(tmp_path_factory.mktemp(f), f) for f in FAMILIES}


def hf_config(make_config, path, *overrides):
    return make_config(f"model.hf={path}", "train.steps=3", LONG_RUN_LR, *overrides)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_cut_computes_the_models_own_forward_and_stages_build_only_their_layers(tmp_path, family):
    import transformers

    path = write_hf_model(tmp_path, family, tied=family in ("qwen2", "gpt2"))
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    whole, num_layers = build_hf_stage(path, "layers", 0, None)
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        assert torch.equal(nn.Sequential(*whole)(ids), want)
    assert num_layers == 4  # embedding, two decoder layers, norm + head
    if family in ("llama", "mistral"):  # untied: a stage holds only its own layers' tensors
        first, _ = build_hf_stage(path, "layers", 0, [0, 1])
        last, _ = build_hf_stage(path, "layers", 0, [2, 3])
        with torch.no_grad():
            assert torch.equal(nn.Sequential(*last)(nn.Sequential(*first)(ids)), want)
        assert sum(p.numel() for m in first for p in m.parameters()) < sum(p.numel() for p in model.parameters())


PP2 = ("parallel.pp=2", "parallel.microbatches=2", "parallel.schedule=1f1b")


def test_a_family_trains_on_actors_to_the_single_process_parameters(ray_session, make_config, hf_dirs):
    """Llama under pp=2 with its layers recomputed (train.activation_checkpointing, which changes no
    math either) on real actors; the other families' cuts run in forked stages below."""
    cfg = hf_config(make_config, hf_dirs["llama"], *PP2, "train.activation_checkpointing=true")
    result = train(cfg)
    assert_same_hf_params(checkpoint.load_state_dict(result.checkpoint), reference_state(cfg))
    assert result.metrics[-1]["loss"] < result.metrics[0]["loss"]


FAMILY_RUNS = [
    # the pipeline cut is family-specific: every other family under pp=2 ...
    *(pytest.param(family, PP2, id=f"pp2-1f1b-m2-{family}") for family in FAMILIES if family != "llama"),
    # ... data parallel is not: one family here (a tied GPT-2 at dp=2 below, Llama at dp=2 x pp=2 in the hybrid)
    pytest.param("qwen2", ("parallel.dp=2",), id="dp2-qwen2"),
]


@pytest.mark.parametrize("family, layout", FAMILY_RUNS)
def test_every_family_trains_to_the_single_process_parameters(make_config, hf_dirs, family, layout, tmp_path):
    """The stages run in forked processes (tests/forked_stages.py): the code a StageWorker hosts."""
    cfg = hf_config(make_config, hf_dirs[family], *layout)
    model, _ = run_stages(cfg, str(tmp_path / "stages"))
    assert_same_hf_params(model, reference_state(cfg))


def test_a_hybrid_layout_with_the_split_backward(ray_session, make_config, hf_dirs):
    cfg = hf_config(make_config, hf_dirs["llama"], "parallel.microbatches=2", "parallel.dp=2", "parallel.pp=2",
                    "parallel.schedule=gpipe", "parallel.split_backward=true")
    assert_same_hf_params(checkpoint.load_state_dict(train(cfg).checkpoint), reference_state(cfg))


def test_a_config_without_weights_initialises_the_same_in_every_layout(ray_session, make_config, tmp_path):
    path = write_hf_model(tmp_path, "llama", weights=False)
    cfg = hf_config(make_config, path, "parallel.pp=2", "train.steps=2")
    result = train(cfg)
    assert_same_params(checkpoint.load_state_dict(result.checkpoint), reference_state(cfg))


def test_tied_embeddings_train_data_parallel_export_tied_and_pipeline(ray_session, make_config, tmp_path):
    import transformers

    from raytrain.models.export import export_hf

    path = write_hf_model(tmp_path / "source", "gpt2", tied=True)
    cfg = hf_config(make_config, path, "parallel.dp=2")
    result = train(cfg)
    state = checkpoint.load_state_dict(result.checkpoint)
    assert not any(name.endswith("head.weight") for name in state)  # one tensor, under the embedding's name
    assert_same_hf_params(state, reference_state(cfg))
    # the trained model exports as a tied model transformers loads
    export_hf(result.checkpoint, str(tmp_path / "out"))
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert model.lm_head.weight is model.transformer.wte.weight
    assert torch.equal(model.transformer.wte.weight, state["0.embed.weight"])
    assert torch.equal(model.transformer.h[1].mlp.c_fc.weight, state["2.layer.mlp.c_fc.weight"])
    assert not torch.equal(state["0.embed.weight"], transformers.AutoModelForCausalLM.from_pretrained(path).transformer.wte.weight)
    # a pipeline puts the embedding and the head on two stages, each holding the tied weight (test_any_model
    # trains it to one process's parameters)
    pipelined = prepare(load_config(None, [f"model.hf={path}", "parallel.pp=2", f"run.dir={tmp_path}/runs"]))
    assert [t.name for t in pipelined.model.ties_across(pipelined.stage_layers)] == ["0.embed.weight"]


def _with_extra_module(path):
    """A config whose model the cut cannot take: Bloom keeps an extra embedding norm in its base model."""
    import transformers

    transformers.BloomConfig(vocab_size=256, hidden_size=32, n_layer=2, n_head=4).save_pretrained(path)
    return str(path)


def test_a_family_that_cannot_be_cut_is_named_for_pp_and_trains_whole_for_dp(ray_session, make_config, tmp_path):
    path = _with_extra_module(tmp_path / "bloom")
    with pytest.raises(ValueError, match=r"model.hf=.*BloomForCausalLM.*parallel.pp=1"):
        prepare(load_config(None, [f"model.hf={path}", "parallel.pp=2", f"run.dir={tmp_path}/runs"]))
    cfg = hf_config(make_config, path, "parallel.dp=2", "train.steps=2")
    prepared = prepare(cfg)
    assert prepared.cfg.model.hf_cut == "whole" and prepared.layout.num_layers == 1
    assert_same_params(checkpoint.load_state_dict(train(cfg).checkpoint), reference_state(prepared.cfg))


@pytest.mark.parametrize("overrides, must_mention", [
    (["model.hf=/nonexistent/model"], ["model.hf", "/nonexistent/model", "no such directory"]),
    (["model.seq_len=128"], ["model.seq_len=128", "64 positions"]),
    (["model.hf_cut=sideways"], ["model.hf_cut", "auto, layers, whole"]),
    (["model.factory=tests.factories:forward_raises"], ["model.hf", "not both"]),
    (["parallel.pp=2", "parallel.balance=time"], ["parallel.balance=time", "parallel.balance=params"]),
])
def test_bad_hf_input_is_refused_before_any_actor(hf_dirs, tmp_path, overrides, must_mention):
    with pytest.raises(ValueError) as err:
        prepare(load_config(None, [f"model.hf={hf_dirs['llama']}", f"run.dir={tmp_path}", *overrides]))
    for text in must_mention:
        assert text in str(err.value), f"{text!r} missing from: {err.value}"


@pytest.mark.parametrize("dtype, declared", [(torch.float32, None), (torch.bfloat16, None),
                                             (torch.float32, "bfloat16")],
                         ids=["float32", "bfloat16", "float32-weights-bfloat16-config"])
def test_import_train_at_lr_0_and_export_round_trips_bit_for_bit(ray_session, make_config, tmp_path, dtype, declared):
    import json
    import subprocess
    import sys

    import transformers
    from safetensors.torch import load_file

    from raytrain.models.export import export_hf

    source = write_hf_model(tmp_path / "source", "llama", dtype=dtype)
    if declared:  # the weights' own dtype wins over what config.json declares
        config = json.loads((tmp_path / "source" / "config.json").read_text())
        (tmp_path / "source" / "config.json").write_text(json.dumps({**config, "dtype": declared}))
    cfg = hf_config(make_config, source, "parallel.pp=2", "parallel.microbatches=2", "train.lr=0", "train.steps=2")
    result = train(cfg)
    out = tmp_path / "exported"
    export = [sys.executable, "-m", "raytrain", "export", "--checkpoint", result.checkpoint, "--out", str(out)]
    if declared:  # the CLI, as a user runs it (once: it calls export_hf with the same defaults)
        done = subprocess.run(export, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
    else:
        export_hf(result.checkpoint, str(out))
    want, got = load_file(f"{source}/model.safetensors"), load_file(out / "model.safetensors")
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == dtype and torch.equal(got[name], want[name]), name
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    original = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, original(input_ids=ids).logits)
    if declared:
        again = subprocess.run(export, capture_output=True, text=True, timeout=120)
        assert again.returncode == 2 and "already exists" in again.stderr
    else:
        with pytest.raises(ValueError, match="already exists"):
            export_hf(result.checkpoint, str(out))


def test_sharded_safetensors_load_and_a_directory_without_config_is_named(tmp_path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(write_hf_model(tmp_path / "one", "llama"))
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    layers, _ = build_hf_stage(str(tmp_path / "sharded"), "layers", 0, None)
    ids = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        assert torch.equal(nn.Sequential(*layers)(ids), model.eval()(input_ids=ids).logits)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="model.hf=.*no config.json"):
        prepare(load_config(None, [f"model.hf={tmp_path / 'empty'}", f"run.dir={tmp_path}/runs"]))


def test_a_pretrained_gemma_keeps_its_computed_embedding_scale(tmp_path):
    import transformers

    config = transformers.GemmaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    layers, _ = build_hf_stage(str(tmp_path), "layers", 0, None)  # embed_scale is a buffer beside a weight
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        assert torch.equal(nn.Sequential(*layers)(ids), model(input_ids=ids).logits)


@pytest.mark.parametrize("family", ["gpt_neox", "mixtral", "gemma3", "granite_swa"])
def test_families_whose_files_name_parameters_unlike_their_modules_cut_through_the_conversion_mapping(tmp_path,
                                                                                                    family):
    # GPT-NeoX's files say embed_out for its lm_head, Mixtral's hold each expert's w1/w2/w3 where its
    # modules hold one fused tensor; Gemma 3 gives each layer type its own rotary; Granite SWA each
    # layer a rotary of its own base theta (or none), and scales its embedding and logits. Each stage reads
    # only its own layers' tensors, converted as from_pretrained converts them, and a plain process
    # loads the export named as the source directory was.
    import safetensors.torch
    import transformers

    path = write_hf_model(tmp_path / "model", family)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    prepared = prepare(load_config(None, [f"model.hf={path}", "parallel.pp=2", f"run.dir={tmp_path}/runs"]))
    assert prepared.cfg.model.hf_cut == "layers"
    first, _ = build_hf_stage(path, "layers", 0, [0, 1])
    last, _ = build_hf_stage(path, "layers", 0, [2, 3])
    ids = torch.randint(0, 256, (2, 24))  # longer than Gemma 3's sliding window
    with torch.no_grad():
        assert torch.equal(nn.Sequential(*last)(nn.Sequential(*first)(ids)), model(input_ids=ids).logits)
    assert sum(p.numel() for m in first for p in m.parameters()) < sum(p.numel() for p in model.parameters())
    files = safetensors.torch.load_file(f"{path}/model.safetensors")
    exported = to_file_names(meta_model(model.config), dict(model.named_parameters()))
    assert set(exported) == set(files) and all(torch.equal(exported[k], files[k]) for k in files)


@pytest.mark.parametrize("family", ["gpt_neox", "mixtral"])
def test_converted_families_train_under_pp2_to_the_single_process_parameters(make_config, tmp_path, family):
    # Gemma 3 at tp=2 x pp=2 in tests/test_tp.py; the stages run in forked processes (tests/forked_stages.py)
    path = write_hf_model(tmp_path / "model", family)
    cfg = hf_config(make_config, path, *PP2)
    model, _ = run_stages(cfg, str(tmp_path / "run"))
    assert_same_hf_params(model, reference_state(cfg))


@pytest.mark.parametrize("family", ["gemma2", "gemma3_capped", "cohere", "falcon"])
def test_families_whose_heads_or_layers_need_more_are_cut_with_it_and_pipeline(make_config, tmp_path, family):
    # Gemma 2 caps its logits (cap * tanh(logits / cap); a cap of 1 here, so that it matters; Gemma 3 may), Cohere
    # multiplies them by logit_scale: the cut's head does too. A rotary Falcon's layers take an alibi argument
    # (None). So the cut is the model's own forward and pp=2 trains to the single-process parameters (before,
    # Gemma 2 was refused by 9.2e-5, Cohere by 1.1, Falcon for the argument it was not given).
    import transformers

    path = write_hf_model(tmp_path / "model", family)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    cfg = hf_config(make_config, path, *PP2)
    assert prepare(cfg).cfg.model.hf_cut == "layers"
    first, _ = build_hf_stage(path, "layers", 0, [0, 1])
    last, _ = build_hf_stage(path, "layers", 0, [2, 3])
    ids = torch.randint(0, 256, (2, 24))  # longer than Gemma 2's sliding window
    with torch.no_grad():
        assert torch.equal(nn.Sequential(*last)(nn.Sequential(*first)(ids)), model(input_ids=ids).logits)
    trained, _ = run_stages(cfg, str(tmp_path / "run"))
    assert_same_hf_params(trained, reference_state(cfg))


def test_an_alibi_falcon_is_refused_for_a_pipeline_naming_alibi(tmp_path):
    path = write_hf_model(tmp_path / "model", "falcon_alibi")
    with pytest.raises(ValueError, match=r"FalconForCausalLM.*uses alibi.*parallel.pp=1"):
        prepare(load_config(None, [f"model.hf={path}", "parallel.pp=2", f"run.dir={tmp_path}/runs"]))


def test_weights_missing_a_parameter_train_whole_and_refuse_a_pipeline(tmp_path):
    """A file tensor no conversion makes (here renamed by hand): transformers' own loading decides."""
    import safetensors.torch
    import transformers

    path = write_hf_model(tmp_path / "model", "llama")
    tensors = safetensors.torch.load_file(f"{path}/model.safetensors")
    tensors["model.layers.0.mlp.gate.weight"] = tensors.pop("model.layers.0.mlp.gate_proj.weight")
    safetensors.torch.save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lack 'model.layers.0.mlp.gate_proj.weight'.*parallel.pp=1"):
        prepare(load_config(None, [f"model.hf={path}", "parallel.pp=2", f"run.dir={tmp_path}/runs"]))
    prepared = prepare(load_config(None, [f"model.hf={path}", f"run.dir={tmp_path}/runs", "model.seq_len=16"]))
    assert prepared.cfg.model.hf_cut == "whole"
    layers, _ = build_hf_stage(path, "whole", 0, None)
    assert isinstance(layers[0].model, transformers.LlamaForCausalLM)


def test_weights_raytrain_cannot_read_are_refused_not_ignored(tmp_path):
    write_hf_model(tmp_path, "llama", weights=False)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="pytorch_model.bin.*does not read.*save_pretrained"):
        prepare(load_config(None, [f"model.hf={tmp_path}", f"run.dir={tmp_path}/runs"]))


def test_building_a_model_of_many_layers_is_said_first(capsys):
    from raytrain.models.hf_model import MANY_LAYERS
    from tests.hf_models import hf_config

    meta_model(hf_config("llama", layers=2))
    assert capsys.readouterr().err == ""
    meta_model(hf_config("llama", layers=MANY_LAYERS))  # about a second: a config of 20,000 took minutes, silently
    assert f"building the structure of its {MANY_LAYERS} layers (no weights yet" in capsys.readouterr().err
