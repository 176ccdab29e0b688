"""Models and settings that would silently break exactness are refused with a clear message."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import transformers
from packaging.version import Version

import lightning_dta as dta
from lightning_dta.engine.model_info import DOGE_CAUSAL_SDPA
from tests.helpers.models import make_model


class NoCacheLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(48, 8)
        self.head = torch.nn.Linear(8, 48)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return self.head(self.embed(input_ids))


def tiny_tree() -> dta.PrefixTree:
    return dta.PrefixTree.from_rollouts([dta.Rollout(input_ids=[1, 2, 3]), dta.Rollout(input_ids=[1, 2, 4])])


def test_model_without_cache_is_refused():
    with pytest.raises(dta.ModelNotSupportedError, match="takes no KV cache.*Fix:"):
        dta.tree_backward(NoCacheLM(), tiny_tree(), dta.PolicyLoss())


def test_gradient_checkpointing_is_refused():
    model = make_model("llama")
    model.gradient_checkpointing_enable()
    model.train()
    with pytest.raises(dta.ModelNotSupportedError, match="gradient checkpointing.*activation='recompute'"):
        dta.tree_backward(model, tiny_tree(), dta.PolicyLoss())


def test_dropout_with_recompute_is_refused():
    model = make_model("gpt2")
    model.config.resid_pdrop = 0.1
    model.transformer.drop.p = 0.1
    model.train()
    with pytest.raises(dta.ModelNotSupportedError, match="dropout"):
        dta.tree_backward(model, tiny_tree(), dta.PolicyLoss(), activation="recompute")
    with pytest.raises(dta.ModelNotSupportedError, match="activation='auto' re-runs chunks.*dropout"):
        dta.tree_backward(model, tiny_tree(), dta.PolicyLoss(), activation="auto", activation_memory_budget=10**9)
    model.eval()
    dta.tree_backward(model, tiny_tree(), dta.PolicyLoss(), activation="recompute")


@pytest.mark.parametrize("kwargs", [dict(mode="tree"), dict(activation="lazy"), dict(chunk_size=0),
                                    dict(order="random"), dict(sibling_batch_tokens=0)])
def test_bad_options_are_refused(kwargs):
    with pytest.raises(ValueError):
        dta.tree_backward(make_model("llama"), tiny_tree(), dta.PolicyLoss(), **kwargs)


def test_bad_loss_settings_are_refused():
    with pytest.raises(ValueError, match="agg"):
        dta.PolicyLoss(agg="mean")


def test_mask_mode_refuses_attention_kernels_without_4d_masks():
    model = make_model("llama")
    model.config._attn_implementation = "flash_attention_2"  # only the name is read before refusing
    with pytest.raises(dta.ModelNotSupportedError, match="mode='mask'.*sdpa"):
        dta.tree_backward(model, tiny_tree(), dta.PolicyLoss(), mode="mask")


def test_prefix_attention_where_unsupported_is_refused_or_skipped():
    """A sliding-window model keeps its own attention (which applies the window); asking for prefix attention
    on it is an error that names the reason."""
    model = make_model("mistral")
    with pytest.raises(dta.ModelNotSupportedError, match="prefix_attention=True.*sliding"):
        dta.tree_backward(model, tiny_tree(), dta.PolicyLoss(), prefix_attention=True)
    dta.tree_backward(model, tiny_tree(), dta.PolicyLoss())  # auto: falls back to the model's attention with a KV cache


def test_prefix_attention_switch_is_undone():
    """The attention implementation is swapped only during a segment's forward, also when one fails."""
    model = make_model("llama")
    dta.tree_backward(model, tiny_tree(), dta.PolicyLoss(), prefix_attention=True)
    assert model.config._attn_implementation == "sdpa"

    def fail(*args):
        raise RuntimeError("boom")

    handle = model.model.layers[1].register_forward_hook(fail)
    with pytest.raises(RuntimeError, match="boom"):
        dta.tree_backward(model, tiny_tree(), dta.PolicyLoss(), prefix_attention=True)
    handle.remove()
    assert model.config._attn_implementation == "sdpa"
    model(input_ids=torch.tensor([[1, 2, 3]]))  # the model still runs on its own


def test_prefix_attention_outside_the_engine_is_an_error():
    from lightning_dta.engine.prefix_attention import ATTENTION_NAME, SWITCH

    SWITCH.register()  # what the engine's first switch does
    model = make_model("llama")
    model.config._attn_implementation = ATTENTION_NAME
    with pytest.raises(RuntimeError, match="only runs inside"):
        model(input_ids=torch.tensor([[1, 2, 3]]))


def test_a_layer_that_hands_over_no_keys_values_is_refused():
    """If some layer's attention bypasses the engine (a custom attention path, a layer without KV cache), its
    prefix would be missing for the children: refuse instead of training on something else."""
    model = make_model("llama")
    attention = model.model.layers[1].self_attn
    original = attention.forward

    def bypass(hidden_states, *args, **kwargs):  # mixes tokens without keys/values (a stand-in for SSM layers)
        return torch.cumsum(hidden_states, dim=1), None

    for prefix_attention in (True, False):
        attention.forward = bypass
        with pytest.raises(dta.ModelNotSupportedError, match="1 of its 2 layers"):
            dta.tree_backward(model, tiny_tree(), dta.PolicyLoss(), prefix_attention=prefix_attention)
        attention.forward = original


@pytest.mark.parametrize("family,reason", [("doge-eager", "own attention mask or bias"),
                                           # (transformers 5.0-5.10: DiffLlama's own classes bypass the interface)
                                           ("diffllama", "more than once per layer|0 of its 2 layers call"),
                                           ("mistral", "sliding attention window")])
def test_prefix_attention_refuses_what_it_cannot_compute(family, reason):
    with pytest.raises(dta.ModelNotSupportedError, match=f"prefix_attention=True, but .*({reason})"):
        dta.tree_backward(make_model(family), tiny_tree(), dta.PolicyLoss(), prefix_attention=True)


@pytest.mark.parametrize("implementation", ["sdpa", "flex_attention"])
def test_doge_without_a_causal_forward_is_refused(implementation):
    """Doge's dynamic mask drops the causal mask under flex attention, and under sdpa before transformers 5.18:
    its own forward attends to later tokens, which no shared prefix can reproduce."""
    model = make_model("doge")
    model.config._attn_implementation = implementation  # only the name is read before refusing
    if implementation == "sdpa" and Version(transformers.__version__) >= DOGE_CAUSAL_SDPA:
        dta.tree_backward(model, tiny_tree(), dta.PolicyLoss())
        return
    for mode in ("dfs", "mask"):
        with pytest.raises(dta.ModelNotSupportedError, match="dynamic mask.*attn_implementation='eager'"):
            dta.tree_backward(model, tiny_tree(), dta.PolicyLoss(), mode=mode)
    if implementation == "sdpa":  # (flex attention on the CPU takes no float64)
        dta.tree_backward(model, tiny_tree(), dta.PolicyLoss(), mode="vanilla")  # the model's own forward


def test_doge_moe_is_refused():
    """Doge's MoE router mixes the routing logits of different tokens (not causal in any version)."""
    config = transformers.DogeConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, is_moe=True, num_experts=16,
                                     num_experts_per_tok=2, attn_implementation="eager")
    with pytest.raises(dta.ModelNotSupportedError, match="MoE router.*mode='vanilla'"):
        dta.tree_backward(transformers.DogeForCausalLM(config), tiny_tree(), dta.PolicyLoss())


def test_attention_dropout_falls_back_to_the_model_attention():
    model = make_model("llama")
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    model.train()
    with pytest.raises(dta.ModelNotSupportedError, match="attention dropout"):
        dta.tree_backward(model, tiny_tree(), dta.PolicyLoss(), prefix_attention=True)
    dta.tree_backward(model, tiny_tree(), dta.PolicyLoss())  # auto: the model's attention applies the dropout itself
    model.eval()
    dta.tree_backward(model, tiny_tree(), dta.PolicyLoss(), prefix_attention=True)  # no dropout in eval mode


def test_overlapping_switches_restore_the_model_attention_once():
    """Two engine runs on one model overlapping in time (threads) must leave the model's own attention."""
    from lightning_dta.engine.attention_backends import CPUFlashBackend
    from lightning_dta.engine.prefix_attention import (
        ATTENTION_NAME,
        attention_configs,
        attention_switch,
        original_implementation,
    )

    model = make_model("llama")
    configs = attention_configs(model)
    backend = CPUFlashBackend()
    first = attention_switch(configs, backend, None, ((0, 2),))
    second = attention_switch(configs, backend, None, ((0, 2),))
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert model.config._attn_implementation == ATTENTION_NAME  # the second run is still inside
    assert original_implementation(model.config) == "sdpa"
    second.__exit__(None, None, None)
    assert model.config._attn_implementation == "sdpa"


def test_probe_leaves_the_random_stream_alone():
    """Deciding on prefix attention runs a probe forward; with dropout active it must not consume random numbers
    that training would otherwise have drawn."""
    from lightning_dta.engine.attention_backends import CPUFlashBackend
    from lightning_dta.engine.prefix_attention import probe

    model = make_model("gpt2")
    model.transformer.drop.p = 0.1
    model.train()
    torch.manual_seed(3)
    expected = torch.rand(3)
    torch.manual_seed(3)
    assert probe(model, model.config.num_hidden_layers, CPUFlashBackend(), torch.float32).reason is None
    assert torch.equal(torch.rand(3), expected)


class NoCacheOutputLM(NoCacheLM):
    """A model whose forward takes no cache, returning its logits as transformers models do."""

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return transformers.modeling_outputs.CausalLMOutput(logits=super().forward(input_ids))


def refused_model(name: str) -> torch.nn.Module:
    """A float64 model the tree walk refuses, each for its own reason."""
    if name == "no KV cache (logits)":
        model = NoCacheLM()
    elif name == "no KV cache (output)":
        model = NoCacheOutputLM()
    elif name == "a layer kind the engine does not walk":  # Jamba: a Mamba (1) mixer, which carries no layer_type
        model = transformers.JambaForCausalLM(transformers.JambaConfig(
            vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4, num_experts=1,
            attn_layer_period=2, attn_layer_offset=1))
    else:
        model = transformers.DogeForCausalLM(transformers.DogeConfig(
            vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, is_moe=True, num_experts=16, num_experts_per_tok=2, attn_implementation="eager"))
    torch.manual_seed(0)
    return model.double().eval()


def engine_fix(message: str) -> dict[str, str]:
    """The engine settings the refusal's fix names (``Fix: mode='vanilla'`` -> ``{"mode": "vanilla"}``)."""
    fix = message.split("Fix:", 1)[1]
    names = "|".join(f.name for f in dataclasses.fields(dta.EngineOptions))
    return dict(re.findall(rf"\b({names})='([^']*)'", fix))


@pytest.mark.parametrize("name", ["no KV cache (logits)", "no KV cache (output)",
                                  "a layer kind the engine does not walk", "MoE router"])
def test_the_fix_of_every_model_refusal_runs(name: str) -> None:
    """Issue 32: the refused model, with the fix its refusal names, runs the forward-only walk (which the warm start
    and the reference log-probs call) and training, and the log-probs are the definition's: each rollout alone
    through the model's own forward, log-softmax at every position."""
    model = refused_model(name)
    tree = dta.PrefixTree.from_rollouts([dta.Rollout(input_ids=[1, 2, 3, 5], advantages=1.0),
                                         dta.Rollout(input_ids=[1, 2, 4], advantages=-0.5)])
    with pytest.raises(dta.ModelNotSupportedError, match="Fix:") as refused:
        dta.tree_logprobs(model, tree)
    fix = engine_fix(str(refused.value))
    assert fix == {"mode": "vanilla"}, str(refused.value)
    got = dta.tree_logprobs(model, tree, **fix)
    for ids, logprobs in zip(tree.token_tensors, got):
        output = model(input_ids=ids[None])
        logits = (output if isinstance(output, torch.Tensor) else output.logits)[0, :-1]
        expected = torch.log_softmax(logits, dim=-1).gather(1, ids[1:, None])[:, 0]
        torch.testing.assert_close(logprobs, expected, rtol=0, atol=1e-12)
    with pytest.raises(dta.ModelNotSupportedError):
        dta.tree_backward(model, tree, dta.PolicyLoss())
    dta.tree_backward(model, tree, dta.PolicyLoss(), **fix)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_the_fix_of_the_gradient_checkpointing_refusal_runs() -> None:
    model = make_model("llama")
    model.gradient_checkpointing_enable()
    model.train()
    with pytest.raises(dta.ModelNotSupportedError, match="Fix: call model.gradient_checkpointing_disable"):
        dta.tree_backward(model, tiny_tree(), dta.PolicyLoss())
    model.gradient_checkpointing_disable()
    tree = dta.PrefixTree.from_rollouts([dta.Rollout(input_ids=[1, 2, 3], advantages=1.0)])
    dta.tree_backward(model, tree, dta.PolicyLoss(), activation="recompute", chunk_size=2)
