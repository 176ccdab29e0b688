"""What the attention adapter (``lightning_dta/engine/hf_attention.py``) relies on in transformers, pinned: a release
that changes the attention dispatch fails here, by name, instead of training on the wrong attention."""

from __future__ import annotations

import threading

import pytest
import torch

from lightning_dta.engine.hf_attention import AttentionSwitch, attention_configs
from tests.helpers.models import make_model

FAMILIES = ["llama", "qwen3", "gpt2"]


class Recorder:
    """An attention implementation that records its calls and computes plain attention (so the forward runs)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        self.calls.append((getattr(module, "layer_idx", None), tuple(query.shape), tuple(key.shape)))
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
        return out.transpose(1, 2).contiguous(), None


@pytest.mark.parametrize("family", FAMILIES)
def test_switched_configs_call_the_registered_function_once_per_layer(family: str) -> None:
    model = make_model(family).eval()
    recorder = Recorder()
    switch = AttentionSwitch(f"pin_{family}", recorder)
    configs = attention_configs(model)
    assert configs, "attention modules carry a layer_idx and a config"
    own = model.config._attn_implementation
    ids = torch.tensor([[1, 2, 3, 4]])
    with switch.on(configs):
        assert all(c._attn_implementation == f"pin_{family}" for c in configs)  # the property reads the field
        assert switch.original(model.config) == own
        model(input_ids=ids)
    layers = model.config.get_text_config().num_hidden_layers
    assert sorted(call[0] for call in recorder.calls) == list(range(layers))  # each layer once, by layer_idx
    assert all(len(q) == 4 and q[2] == 4 for _, q, _ in recorder.calls)  # [batch, heads, tokens, head_dim]
    assert model.config._attn_implementation == own  # restored
    recorder.calls.clear()
    model(input_ids=ids)
    assert recorder.calls == []  # the model's own attention again


def test_overlapping_switches_restore_the_model_attention_once() -> None:
    model = make_model("llama")
    switch = AttentionSwitch("pin_overlap", Recorder())
    configs = attention_configs(model)
    first, second = switch.on(configs), switch.on(configs)
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert model.config._attn_implementation == "pin_overlap"
    second.__exit__(None, None, None)
    assert model.config._attn_implementation == "sdpa"
    errors = []

    def run() -> None:
        try:
            for _ in range(50):
                with switch.on(configs):
                    pass
        except Exception as error:  # noqa: BLE001 (collected for the assertion below)
            errors.append(error)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and model.config._attn_implementation == "sdpa"


def test_importing_the_package_registers_no_attention_function() -> None:
    """Registration happens at the first switch (the probe of a model), not on import."""
    import subprocess
    import sys

    code = ("import lightning_dta; from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as F; "
            "import sys; sys.exit(int('lightning_dta_prefix' in F))")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
