"""Tiny Hugging Face causal LMs (FAMILIES, and the families tensor parallelism and the conversion mapping
add: Qwen3, Gemma 2, Gemma 3, Cohere, Falcon, Mixtral, GPT-NeoX, DeepSeek-V2, Granite SWA, Qwen2-MoE, Starcoder2), written to a directory as ``save_pretrained`` does."""

import logging

import torch

from tests.helpers import assert_same_params

FAMILIES = ("llama", "qwen2", "mistral", "gpt2")


def hf_config(family: str, tied: bool = False, layers: int = 2):
    """A config of ``family`` small enough for a test: vocab 256 (the built-in corpus is bytes)."""
    import transformers as T

    logging.getLogger("transformers").setLevel(logging.ERROR)
    if family == "gpt2":
        return T.GPT2Config(vocab_size=256, n_embd=32, n_layer=layers, n_head=4, n_positions=64, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, tie_word_embeddings=tied)
    common = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied)
    if family == "mistral":
        return T.MistralConfig(**common, sliding_window=8)  # shorter than model.seq_len: the window mask matters
    if family == "qwen3":  # per-head q/k norms; its head_dim defaults to 128
        return T.Qwen3Config(**common, head_dim=8)
    if family in ("gemma3", "gemma3_capped"):  # a rotary per layer type (local for sliding layers), per-head q/k
        # norms; capped: its output logits soft-capped as Gemma 2's (off by default in Gemma 3)
        return T.Gemma3TextConfig(**common, head_dim=8, sliding_window=8,
                                  final_logit_softcapping=1.0 if family == "gemma3_capped" else None,
                                  layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(layers)])
    if family == "gemma2":  # a soft cap on its attention logits and on its output logits, a sliding window
        return T.Gemma2Config(**common, head_dim=8, sliding_window=8, final_logit_softcapping=1.0)
    if family == "cohere":  # its logits multiplied by logit_scale (0.0625)
        return T.CohereConfig(**common)
    if family in ("falcon", "falcon_alibi"):  # layers that take an alibi argument (None with a rotary)
        return T.FalconConfig(vocab_size=256, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                              max_position_embeddings=64, tie_word_embeddings=tied, alibi=family == "falcon_alibi",
                              new_decoder_architecture=True, num_kv_heads=2)
    if family == "mixtral":  # experts whose files hold w1/w2/w3 each, fused into gate_up_proj/down_proj in the model
        return T.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    if family == "gemma4_moe":  # experts beside its MLP, called by the decoder layer itself; no per-layer inputs
        # (its default global head of 512 with no 1/sqrt(d) scaling saturates the softmax of this random model:
        # a sum in another order moves a step by 2e-4; 8 keeps it to rounding)
        return T.Gemma4TextConfig(**common, head_dim=8, global_head_dim=8, moe_intermediate_size=16, enable_moe_block=True,
                                  num_experts=4, top_k_experts=2, hidden_size_per_layer_input=0, sliding_window=8,
                                  layer_types=["sliding_attention", "full_attention"][:layers])
    if family == "nemotron_h":  # a Mamba layer, an attention layer and a mixture: only its experts split
        return T.NemotronHConfig(vocab_size=256, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=tied,
                                 layers_block_type=["mamba", "attention", "moe"], n_routed_experts=4,
                                 num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=16,
                                 mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, n_groups=1)
    if family == "olmo2":  # q/k norms over all heads at once: its plan gathers q/k/v (colwise_gather_output)
        return T.Olmo2Config(**common, pad_token_id=0)
    if family == "phi3":  # fused q/k/v and gate/up, gathered, then split again into o/down (rowwise_split_input)
        return T.Phi3Config(**common, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)
    if family == "phi":  # a partial rotary (half of each head), biased q/k/v
        return T.PhiConfig(**common, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)
    if family == "gpt_neox":  # files call its head embed_out; fused per-head q/k/v; a partial rotary by default
        return T.GPTNeoXConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                               num_attention_heads=4, max_position_embeddings=64, tie_word_embeddings=tied,
                               hidden_dropout=0.0, attention_dropout=0.0)
    if family == "deepseek_v2":  # latent attention (its rotary key shared by every head), experts and shared experts
        return T.DeepseekV2Config(vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                                  n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=2, kv_lora_rank=16,
                                  q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                                  max_position_embeddings=64, tie_word_embeddings=tied)
    if family == "granite_swa":  # attention sinks (one learnt logit per head), a sliding window, a rotary per
        # base theta (the second layer none), Granite's scaled embedding and logits
        return T.GraniteSWAConfig(**common, sliding_window=8, bos_token_id=0, eos_token_id=0, embedding_multiplier=2.0,
                                  logits_scaling=3.0, layer_rope_theta=[10000.0, 0.0][:layers] + [500.0] * (layers - 2))
    if family == "granitemoe_swa":  # Granite SWA's sinks and rotaries with a mixture of experts
        return T.GraniteMoeSWAConfig(**common, sliding_window=8, num_local_experts=4, bos_token_id=0, eos_token_id=0)
    if family == "mimo_v2_flash":  # sinks, a dense first MLP then experts, wider q/k heads than v
        return T.MiMoV2FlashConfig(**common, sliding_window=8, head_dim=8, v_head_dim=4, moe_intermediate_size=16,
                                   n_routed_experts=4, num_experts_per_tok=2)
    # OLMo: norms without parameters, in its layers and before its head
    if family == "qwen2_moe":  # experts and a gated shared expert in every layer
        return T.Qwen2MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                shared_expert_intermediate_size=16)
    if family == "starcoder2":  # biased projections, a plain (not gated) MLP, LayerNorm
        return T.Starcoder2Config(**common, residual_dropout=0.0, embedding_dropout=0.0, attention_dropout=0.0)
    return {"llama": T.LlamaConfig, "qwen2": T.Qwen2Config, "olmo": T.OlmoConfig}[family](**common)


def write_hf_model(path, family: str, weights: bool = True, tied: bool = False, seed: int = 0, dtype=torch.float32) -> str:
    """``save_pretrained`` a randomly initialised model (``weights``) or only its config into ``path``."""
    import transformers as T

    config = hf_config(family, tied)
    if not weights:
        config.save_pretrained(path)
        return str(path)
    torch.manual_seed(seed)
    T.AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(path)
    return str(path)


def key_bias_apart(state: dict, heads: int = 4) -> tuple[dict, dict]:
    """``state`` without its attention key biases, and those biases (Qwen2's k_proj.bias, the middle
    third of GPT-2's fused c_attn.bias, the middle of each head's q/k/v in GPT-NeoX's query_key_value)."""
    rest, key_bias = {}, {}
    for name, tensor in state.items():
        if name.endswith("k_proj.bias"):
            key_bias[name] = tensor
        elif name.endswith("c_attn.bias"):
            q, k, v = tensor.chunk(3)
            rest[name] = torch.cat([q, v])
            key_bias[name] = k
        elif name.endswith("query_key_value.bias"):
            per_head = tensor.view(heads, 3, -1)
            rest[name] = per_head[:, ::2].reshape(-1)
            key_bias[name] = per_head[:, 1].reshape(-1)
        else:
            rest[name] = tensor
    return rest, key_bias


def assert_same_hf_params(got: dict, want: dict, rtol: float = 1e-5) -> None:
    """Equal to 1e-5 relative, but for key biases: softmax ignores a key bias (where no rotary turns it:
    all of GPT-2's, the dimensions a partial rotary leaves alone in GPT-NeoX's and Phi's), so its exact
    gradient is 0 and the computed one float noise, which AdamW scales to full-size steps of random sign
    (why the built-in GPT has none). Nothing downstream depends on them, so they are left out."""
    assert_same_params(key_bias_apart(got)[0], key_bias_apart(want)[0], rtol)
