"""Every option of the tree engine in one typed object, :class:`EngineOptions`.

One place defines each option, its type, its default and its check; everything that runs the engine
(``tree_backward``, ``tree_logprobs``, the step functions, ``DTAModule``, the online RL source, the bench)
takes an ``EngineOptions`` and hands it on unchanged. In YAML it is a nested block (``model.engine``) whose
field docstrings are the CLI help. Every combination of options computes exactly the same gradients; they
only trade memory against speed. The one exception is ``policy_temperature``, which says which policy is trained
(the distribution softmax(logits / T) the rollouts were sampled from); it reaches every walk, so that the
training walk and the forward-only walks score the same policy.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args, get_origin, get_type_hints

from lightning_dta.core.errors import ConfigError

Mode = Literal["dfs", "vanilla", "mask"]
Activation = Literal["keep", "recompute", "auto"]
Order = Literal["leaves-first", "tree"]
AttentionBackendName = Literal["cpu-flash", "cuda-flash", "flash-attn", "reference"]


@dataclass(frozen=True)
class EngineOptions:
    """How ``tree_backward`` and ``tree_logprobs`` walk a prefix tree (all options are exact)."""

    mode: Mode = "dfs"
    """"dfs" (the method: push / visit / pop), "vanilla" (every rollout on its own: the reference and the
    baseline) or "mask" (the whole tree packed into one sequence under a tree attention mask)."""

    activation: Activation = "keep"
    """dfs: "keep" keeps each chunk's graph until it is popped; "recompute" pushes without a graph and
    re-forwards the chunk with grad at its pop (memory: the path's keys/values and their gradients plus one
    chunk's activations); "auto" keeps while the path's kept activations fit activation_memory_budget and
    recomputes the rest (with chunk_size, recompute and auto forward one chunk's tokens at a time)."""

    activation_memory_budget: int | None = None
    """dfs, activation="auto" only (required there): bytes that tensors saved for backward may hold at once: the
    path's key/value buffers (attention saves views of them), the kept path and the batch being forwarded."""

    chunk_size: int | None = None
    """dfs and forward-only walks: split nodes into chunks of at most this many tokens, popped back to front
    (null: one chunk per node)."""

    sibling_batch_tokens: int | None = 4096
    """dfs and forward-only walks: forward up to this many tokens of sibling chunks together over their shared
    prefix (packed into one row under prefix attention, padded rows otherwise); null forwards each alone. Under
    prefix attention, forward-only walks pack cousins too (pending chunks of any parent, each over its own
    ancestors; not for hybrids, whose recurrent layers would run one scan across them)."""

    order: Order = "leaves-first"
    """dfs and forward-only walks: "leaves-first" (leaf children first, then subtrees from the smallest; each
    batch of similar lengths) or "tree" (the tree's own order)."""

    prefix_attention: bool | None = None
    """dfs and forward-only walks: attend to the shared prefix without copying or masking it (one flash call
    over the prefix for all packed siblings, one causal call per chunk, merged by log-sum-exp). null: where the
    model supports it; true: required; false: the model's own attention over a KV cache."""

    prefix_attention_backend: AttentionBackendName | None = None
    """dfs and forward-only walks: prefix attention's kernels: "cpu-flash" (PyTorch's CPU flash attention),
    "cuda-flash" (PyTorch's CUDA varlen flash kernels), "flash-attn" (the flash_attn package) or "reference"
    (plain PyTorch, any device and dtype, materialises the scores: for tests). null: the device's default
    (cpu-flash on the CPU; cuda-flash, else flash-attn, on CUDA in bf16/fp16). Every backend is checked against
    the model's attention on the device before the first step, and falls back to it with a warning if they
    disagree."""

    mask_max_tokens: int | None = None
    """mask: pack at most this many tree tokens per forward (sharing across packs is lost); null: whole tree."""

    vanilla_batch_tokens: int | None = None
    """vanilla: right-padded micro-batches of at most this many tokens (rows x longest row); null: one rollout
    per forward."""

    policy_temperature: float = 1.0
    """every mode and walk: log-probs and entropies are those of softmax(logits / policy_temperature), the policy
    the rollouts were sampled from (TRL's and verl's temperature). Unlike the other options it changes the loss:
    it defines the policy. A critic's values ignore it."""

    def __post_init__(self) -> None:
        hints = get_type_hints(type(self))
        for spec in dataclasses.fields(self):
            value = getattr(self, spec.name)
            names = _names(hints[spec.name])
            if names:  # a Literal of names, or of names and null
                if value not in names:
                    raise ConfigError(f"EngineOptions.{spec.name}={value!r} is unknown. Fix: one of {list(names)}")
            elif spec.name == "prefix_attention":
                if value not in (None, True, False):
                    raise ConfigError(f"EngineOptions.prefix_attention={value!r}. Fix: null, true or false")
            elif spec.name == "policy_temperature":
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                        value > 0 and math.isfinite(value)):
                    raise ConfigError(f"EngineOptions.policy_temperature={value!r}. Fix: a positive number (1: "
                                      "the model's own distribution)")
            elif value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(f"EngineOptions.{spec.name}={value!r}: a count of tokens or bytes. Fix: null or a "
                                  "positive int")
        if (self.activation == "auto") != (self.activation_memory_budget is not None):
            raise ConfigError(f"EngineOptions.activation_memory_budget is required by activation='auto' and used by "
                             f"nothing else (activation={self.activation!r}, activation_memory_budget="
                             f"{self.activation_memory_budget!r})")

    @classmethod
    def resolve(cls, engine: EngineOptions | Mapping[str, Any] | None = None, **overrides: Any) -> EngineOptions:
        """``engine`` (default ``EngineOptions()``; a mapping of fields, e.g. from a checkpoint, works too) with
        ``overrides`` applied. An unknown name raises ``TypeError`` listing the fields."""
        if engine is None:
            engine = cls()
        elif isinstance(engine, Mapping):
            engine = cls(**_known(cls, dict(engine)))
        elif not isinstance(engine, cls):
            raise TypeError(f"engine must be an EngineOptions, a mapping of its fields or None, got "
                            f"{type(engine).__name__}")
        return dataclasses.replace(engine, **_known(cls, overrides)) if overrides else engine

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain data (for checkpoints and logs)."""
        return dataclasses.asdict(self)


def _known(cls: type, values: dict[str, Any]) -> dict[str, Any]:
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise TypeError(f"unknown engine option(s) {unknown}; EngineOptions has {names}")
    return values


def _names(hint: Any) -> tuple:
    """The values a ``Literal`` type (or ``Literal | None``) allows; ``()`` for any other type."""
    if get_origin(hint) is Literal:
        return get_args(hint)
    args = get_args(hint)
    if type(None) in args:
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1 and get_origin(inner[0]) is Literal:
            return (*get_args(inner[0]), None)
    return ()


def choices(field_name: str) -> tuple[str, ...]:
    """The allowed names of a ``Literal`` field of :class:`EngineOptions` (e.g. ``choices("mode")``)."""
    return tuple(n for n in _names(get_type_hints(EngineOptions)[field_name]) if n is not None)
