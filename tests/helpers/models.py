"""Tiny randomly initialised causal LMs of every tested family, and rollout generators for the engine tests."""

from __future__ import annotations

import random

import torch
from transformers import (
    DiffLlamaConfig,
    DiffLlamaForCausalLM,
    DogeConfig,
    DogeForCausalLM,
    GemmaConfig,
    GemmaForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

import lightning_dta as dta
from tests.helpers.float64 import without_float32_islands

VOCAB = 48
MAX_POS = 256


def make_model(family: str, dtype: torch.dtype = torch.float64, seed: int = 0) -> torch.nn.Module:
    """A tiny randomly initialised causal LM of the given family, dropout off, in ``dtype``; in float64 with no
    float32 step inside (tests/helpers/float64.py), so that float64 tests can hold it to rounding."""
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB)
    if family == "llama":
        config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=MAX_POS, **common)
        model = LlamaForCausalLM(config)
    elif family == "qwen2":
        config = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=MAX_POS, **common)
        model = Qwen2ForCausalLM(config)
    elif family == "qwen3":  # q/k norms inside attention
        config = Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=8, max_position_embeddings=MAX_POS, **common)
        model = Qwen3ForCausalLM(config)
    elif family == "qwen3moe":  # mixture of experts; its attention passes config.sliding_window as it finds it
        config = Qwen3MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
                                num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=8, max_position_embeddings=MAX_POS, **common)
        model = Qwen3MoeForCausalLM(config)
        model.set_experts_implementation("eager")  # the grouped-mm experts take no float64
    elif family == "mistral":  # a sliding window longer than every test rollout
        config = MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=MAX_POS, sliding_window=MAX_POS,
                               **common)
        model = MistralForCausalLM(config)
    elif family == "gemma":  # scaled embeddings, tied head, GELU MLP
        config = GemmaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=1, head_dim=8, max_position_embeddings=MAX_POS, **common)
        model = GemmaForCausalLM(config)
    elif family == "gemma2kv":  # the same Gemma with 2 key/value heads: a tensor-parallel size of 2 divides them
        config = GemmaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=8, max_position_embeddings=MAX_POS, **common)
        model = GemmaForCausalLM(config)
    elif family in ("doge", "doge-eager"):  # builds its own dynamic attention bias and passes it as the mask
        # "doge": the default implementation (sdpa), causal only with transformers >= 5.18
        extra = dict(attn_implementation="eager") if family == "doge-eager" else {}
        config = DogeConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=MAX_POS, **extra, **common)
        model = DogeForCausalLM(config)
    elif family == "diffllama":  # calls attention twice per layer (differential attention)
        config = DiffLlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=MAX_POS, **common)
        model = DiffLlamaForCausalLM(config)
    elif family in HYBRID_FAMILIES:
        model = make_hybrid(family)
    elif family == "gpt2":
        config = GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=MAX_POS, resid_pdrop=0.0, embd_pdrop=0.0,
                            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, **common)
        model = GPT2LMHeadModel(config)
    else:
        raise ValueError(family)
    # Larger-than-default weights make logits far from uniform, so ratios and clipping are exercised.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    model = model.to(dtype)
    return without_float32_islands(model) if dtype == torch.float64 else model


def random_tree_rollouts(rng: random.Random, num_rollouts: int = 10, max_depth: int = 3,
                         per_token: bool = True, with_logprobs: bool = True) -> list[dta.Rollout]:
    """Rollouts that branch at several depths, with duplicates and strict prefixes among them."""
    bases: list[list[int]] = [[rng.randrange(VOCAB) for _ in range(rng.randint(2, 12))]]
    rollouts = []
    for _ in range(num_rollouts):
        base = rng.choice(bases)
        ids = base[: rng.randint(1, len(base))] if rng.random() < 0.3 else list(base)
        for _ in range(rng.randint(1, max_depth)):
            ids = ids + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 8))]
        if len(ids) < 2:
            ids = ids + [rng.randrange(VOCAB)]
        bases.append(ids)
        rollouts.append(make_rollout(rng, ids, per_token, with_logprobs))
    rollouts.append(rollouts[rng.randrange(len(rollouts))])  # an exact duplicate
    prefix_of = rollouts[rng.randrange(len(rollouts))].input_ids
    if len(prefix_of) > 3:
        rollouts.append(make_rollout(rng, prefix_of[: len(prefix_of) - 2], per_token, with_logprobs))
    return rollouts


def make_rollout(rng: random.Random, ids: list[int], per_token: bool = True, with_logprobs: bool = True
                 ) -> dta.Rollout:
    n = len(ids)
    mask = [0] + [int(rng.random() < 0.8) for _ in range(n - 1)]
    adv = [rng.gauss(0, 1) for _ in range(n)] if per_token else rng.gauss(0, 1)
    kwargs = {}
    if with_logprobs:
        # Behaviour log-probs far from the model's: ratios far from 1, so clipping is active.
        kwargs["old_logprobs"] = [-rng.uniform(0.5, 7.0) for _ in range(n)]
        kwargs["prox_logprobs"] = [v + rng.uniform(-0.3, 0.3) if v < -0.4 else v for v in kwargs["old_logprobs"]]
        kwargs["ref_logprobs"] = [-rng.uniform(0.5, 7.0) for _ in range(n)]
    return dta.Rollout(input_ids=ids, loss_mask=mask, advantages=adv, **kwargs)


# The engine configurations every objective's exactness test runs (tests/engine/test_objectives.py, test_critic.py).
OBJECTIVE_CONFIGS = {
    "dfs-keep": dict(mode="dfs"),
    "dfs-keep-unbatched": dict(mode="dfs", sibling_batch_tokens=None),
    "dfs-recompute-chunk": dict(mode="dfs", activation="recompute", chunk_size=3),
    "dfs-model-attention": dict(mode="dfs", prefix_attention=False),
    "mask": dict(mode="mask"),
    "vanilla": dict(mode="vanilla"),
}


# Hybrid and state-space families: recurrent layers (Gated DeltaNet, Kimi Delta Attention, short convolutions, Mamba2)
# next to attention.
HYBRID_FAMILIES = ("qwen3_5", "qwen3_next", "lfm2", "mamba2", "nemotron_h", "olmo_hybrid", "lfm2_moe", "bamba",
                   "granitemoehybrid", "kimi_linear", "falcon_h1", "zamba2")
CONV_KERNEL = 4  # the recurrent layers' convolution kernel: chunks of 1-3 tokens are shorter than its window
SCAN_CHUNK = 8  # Mamba2's scan chunk: rollouts of up to ~30 tokens cross several


def make_hybrid(family: str) -> torch.nn.Module:
    """A tiny hybrid of ``family`` with a recurrent layer first, then attention (or only recurrent layers)."""
    from transformers import (
        BambaConfig,
        BambaForCausalLM,
        FalconH1Config,
        FalconH1ForCausalLM,
        GraniteMoeHybridConfig,
        GraniteMoeHybridForCausalLM,
        KimiLinearConfig,
        KimiLinearForCausalLM,
        Lfm2Config,
        Lfm2ForCausalLM,
        Lfm2MoeConfig,
        Lfm2MoeForCausalLM,
        Mamba2Config,
        Mamba2ForCausalLM,
        NemotronHConfig,
        NemotronHForCausalLM,
        OlmoHybridConfig,
        OlmoHybridForCausalLM,
        Qwen3_5ForCausalLM,
        Qwen3_5TextConfig,
        Qwen3NextConfig,
        Qwen3NextForCausalLM,
        Zamba2Config,
        Zamba2ForCausalLM,
    )

    attention = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=MAX_POS)
    delta = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                 linear_conv_kernel_dim=CONV_KERNEL)
    common = dict(vocab_size=VOCAB, hidden_size=32)
    if family == "qwen3_5":
        return Qwen3_5ForCausalLM(Qwen3_5TextConfig(
            intermediate_size=64, num_hidden_layers=3, layer_types=["linear_attention", "full_attention",
                                                                    "linear_attention"],
            **attention, **delta, **common))
    if family == "qwen3_next":  # MoE blocks: eager experts run in float64
        model = Qwen3NextForCausalLM(Qwen3NextConfig(
            intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
            num_experts_per_tok=2, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
            **attention, **delta, **common))
        model.set_experts_implementation("eager")
        return model
    if family == "lfm2":
        return Lfm2ForCausalLM(Lfm2Config(
            intermediate_size=64, num_hidden_layers=3, full_attn_idxs=[1], conv_L_cache=CONV_KERNEL,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POS, **common))
    if family == "olmo_hybrid":
        return OlmoHybridForCausalLM(OlmoHybridConfig(
            intermediate_size=64, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=MAX_POS, pad_token_id=0,
            eos_token_id=0, **delta, **common))
    if family == "lfm2_moe":  # a dense first layer, then MoE blocks (eager experts run in float64)
        model = Lfm2MoeForCausalLM(Lfm2MoeConfig(
            intermediate_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, num_dense_layers=1,
            num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"], conv_L_cache=CONV_KERNEL,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POS, pad_token_id=0, **common))
        model.set_experts_implementation("eager")
        return model
    granite_mamba = dict(mamba_n_heads=8, mamba_d_head=8, mamba_d_state=8, mamba_n_groups=1, mamba_d_conv=CONV_KERNEL,
                         mamba_chunk_size=SCAN_CHUNK, mamba_expand=2, intermediate_size=64, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=MAX_POS, pad_token_id=0, **common)
    if family == "bamba":
        return BambaForCausalLM(BambaConfig(num_hidden_layers=2, attn_layer_indices=[1], **granite_mamba))
    if family == "granitemoehybrid":  # MoE blocks (eager experts run in float64)
        model = GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(
            num_hidden_layers=2, layer_types=["mamba", "attention"], num_local_experts=4, num_experts_per_tok=2,
            shared_intermediate_size=32, **granite_mamba))
        model.set_experts_implementation("eager")
        return model
    if family == "kimi_linear":  # KDA, then MLA attention (one key/value head per query head) with an MoE block
        model = KimiLinearForCausalLM(KimiLinearConfig(
            layer_types=["linear_attention", "full_attention"], num_hidden_layers=2,
            intermediate_size=64, moe_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
            v_head_dim=8, linear_num_heads=4, linear_head_dim=8, linear_conv_kernel_dim=CONV_KERNEL,
            max_position_embeddings=MAX_POS, pad_token_id=0, bos_token_id=0, eos_token_id=0, **common))
        model.set_experts_implementation("eager")
        return model
    if family == "falcon_h1":  # attention and a Mamba2 mixer side by side in every layer (layer type "hybrid")
        return FalconH1ForCausalLM(FalconH1Config(num_hidden_layers=2, mamba_d_ssm=64, head_dim=8, **granite_mamba))
    if family == "zamba2":  # one shared attention block (with per-layer adapters) before the Mamba2 of layers 0 and 2
        return Zamba2ForCausalLM(Zamba2Config(
            num_hidden_layers=3, layers_block_type=["hybrid", "mamba", "hybrid"], num_mem_blocks=1,
            use_shared_attention_adapter=True, adapter_rank=4, use_mem_rope=True, mamba_d_state=8,
            mamba_d_conv=CONV_KERNEL, mamba_expand=2, n_mamba_heads=8, mamba_ngroups=1, chunk_size=SCAN_CHUNK,
            intermediate_size=64, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=MAX_POS,
            pad_token_id=0, **common))  # its adapters add [.., 2 * hidden] to the keys: one KV head per query head
    mamba = dict(n_groups=1, conv_kernel=CONV_KERNEL, chunk_size=SCAN_CHUNK, expand=2)
    if family == "mamba2":
        return Mamba2ForCausalLM(Mamba2Config(num_heads=8, head_dim=8, state_size=8, num_hidden_layers=2, **mamba,
                                              **common))
    if family == "nemotron_h":
        return NemotronHForCausalLM(NemotronHConfig(
            layers_block_type=["mamba", "attention", "mlp"], intermediate_size=64, mamba_num_heads=8,
            mamba_head_dim=8, ssm_state_size=8, **attention, **mamba, **common))
    raise ValueError(family)
