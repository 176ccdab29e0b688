"""Building the models a run trains: a causal LM from a spec (a checkpoint path or hub name, a config dict, a module),
on the meta device for sharded runs, and a critic from any causal LM (:func:`value_model`).

A critic keeps the engine's contract whole: it takes a KV cache, positions and ``logits_to_keep`` exactly as the
policy does (it is the same model class), so ``tree_backward(critic, tree, ValueLoss())`` and ``tree_values(critic,
tree)`` walk the prefix tree like the policy's walks, each shared token computed once. Its "logits" are ``[..., 1]``:
the value of the state at each position (the state the next token is emitted from).
"""

from __future__ import annotations

from collections.abc import Mapping
from os import PathLike
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_dta.core.errors import ConfigError

ModelSpec = str | dict[str, Any] | nn.Module


def _dtype_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """YAML gives dtypes as strings ("bfloat16"); transformers wants ``torch.dtype`` (or "auto")."""
    out = dict(kwargs)
    for key in ("dtype", "torch_dtype"):
        if isinstance(out.get(key), str) and out[key] != "auto":
            dtype = getattr(torch, out[key], None)  # a name from a config: torch's dtypes are module attributes
            if not isinstance(dtype, torch.dtype):
                raise ConfigError(f"model_kwargs.{key}={out[key]!r} is not a torch dtype. Fix: bfloat16, float16, "
                                  "float32 or auto")
            out[key] = dtype
    return out


def config_from_dict(spec: Mapping[str, Any], where: str = "model") -> Any:
    """The transformers config of a config dict (``{"model_type": "llama", ...}``), checked as transformers checks
    it (an unknown type, a hidden size that the heads do not divide, ...): a :class:`ConfigError` naming ``where``
    (the setting, e.g. ``model.model``) otherwise. Cheap: no weights."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    spec = dict(spec)
    model_type = spec.pop("model_type", None)
    if model_type is None:
        raise ConfigError(f"{where}: a model config dict needs a 'model_type'; got the keys {sorted(spec)}. Fix: add "
                          "model_type, e.g. llama, qwen3, mistral, gemma, gpt2")
    if model_type not in CONFIG_MAPPING:
        raise ConfigError(f"{where}.model_type={model_type!r} is not a transformers model type. Fix: a type such as "
                          "llama, qwen2, qwen3, mistral, gemma or gpt2 (transformers' CONFIG_MAPPING lists them all)")
    try:
        return AutoConfig.for_model(model_type, **spec)
    except Exception as error:  # transformers validates configs with several error classes of its own
        cause = error.__cause__ or error
        raise ConfigError(f"{where}: transformers refuses this {model_type} config: {str(cause).rstrip('.')}. Fix: a "
                          "consistent shape (e.g. hidden_size a multiple of num_attention_heads)") from error


def build_causal_lm(model: str | PathLike | Mapping[str, Any] | nn.Module,
                    model_kwargs: Mapping[str, Any] | None = None) -> nn.Module:
    """A causal LM from a local path or hub name (``from_pretrained``), a config dict with a ``model_type``
    (``AutoConfig.for_model`` + ``from_config``: random weights, for tests and tiny runs), or a module as is. A
    spec that cannot be built is a :class:`ConfigError`."""
    from transformers import AutoModelForCausalLM

    kwargs = _dtype_kwargs(model_kwargs or {})
    if isinstance(model, nn.Module):
        return model
    if isinstance(model, Mapping):
        return AutoModelForCausalLM.from_config(config_from_dict(model), **kwargs)
    if isinstance(model, (str, PathLike)):
        try:
            return AutoModelForCausalLM.from_pretrained(model, **kwargs)
        except (OSError, ValueError) as error:  # no such directory or hub model, or not a causal LM
            raise ConfigError(f"model {str(model)!r} cannot be loaded: {error}. Fix: a local Hugging Face model "
                              "directory, a hub name, or a config dict with a model_type") from error
    raise TypeError(f"model must be a path or hub name, a config dict or an nn.Module; got {type(model).__name__}")


def local_checkpoint(model: str | PathLike) -> Path:
    """The local directory of a Hugging Face checkpoint: the path itself, or the hub snapshot (downloaded once)."""
    path = Path(model)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(model), allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))


def build_on_meta(model: str | PathLike, model_kwargs: Mapping[str, Any] | None = None) -> tuple[nn.Module, Path]:
    """The causal LM of a checkpoint with its parameters on the meta device (no memory) and its buffers real, and
    the checkpoint's local directory: a sharding strategy allocates the shards and loads them from it."""
    from transformers import AutoConfig

    path = local_checkpoint(model)
    return causal_lm_on_meta(AutoConfig.from_pretrained(path), **_dtype_kwargs(model_kwargs or {})), path


def causal_lm_on_meta(config, **kwargs: Any) -> nn.Module:
    """``AutoModelForCausalLM.from_config(config, **kwargs)`` with its parameters on the meta device (no memory) and
    its buffers real, tied weights tied.

    ``init_empty_weights`` re-registers every parameter it sees as a new meta parameter, including the one that
    ``tie_weights`` assigns to the output embeddings: inside it, a tied head ends up a parameter of its own, which a
    checkpoint load then skips as a tied key and leaves uninitialised (a silently different model under
    ``dta_fsdp``). So the weights are tied again outside it, where the assignment shares the parameter."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        causal_lm = AutoModelForCausalLM.from_config(config, **kwargs)
    causal_lm.tie_weights()
    return causal_lm


def value_model(model: nn.Module) -> nn.Module:
    """Turn ``model`` (a Hugging Face causal LM) into a critic, in place: its output embeddings become a scalar
    head (zero-initialised, so every value starts at 0) and are untied from the input embeddings. A model that is
    already a critic is returned as it is."""
    # a user's model: not every nn.Module carries a Hugging Face config
    if getattr(getattr(model, "config", None), "is_value_model", False):
        return model
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear):
        raise TypeError(f"{type(model).__name__} has no linear LM head to replace (get_output_embeddings() is "
                        f"{type(head).__name__}); a critic needs a causal LM such as AutoModelForCausalLM")
    value_head = nn.Linear(head.in_features, 1, bias=True, device=head.weight.device, dtype=head.weight.dtype)
    with torch.no_grad():
        value_head.weight.zero_()
        value_head.bias.zero_()
    model.config.tie_word_embeddings = False
    # optional config API: multimodal configs nest a text config
    if getattr(model.config, "get_text_config", None) is not None:
        model.config.get_text_config().tie_word_embeddings = False
    model.set_output_embeddings(value_head)
    model.config.is_value_model = True
    return model
