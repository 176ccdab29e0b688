"""The one place the package touches transformers' attention dispatch, which is private API.

What it relies on (measured on transformers 5.17 and 5.24, and pinned by ``tests/engine/test_hf_attention.py``, so
that a transformers release that changes it fails there, not silently in a training run):

- an attention module reads ``self.config._attn_implementation`` at every forward and calls
  ``ALL_ATTENTION_FUNCTIONS[name](module, query, key, value, attention_mask, scaling=..., dropout=..., **kwargs)``
  (``sdpa`` and ``eager`` included) with ``[batch, heads, tokens, head_dim]`` tensors, after RoPE;
- ``config._attn_implementation`` is a property over the field ``config._attn_implementation_internal``; writing the
  field switches the implementation without the public setter's checks (which would try to load kernels for an
  unknown name);
- ``AttentionInterface.register(name, function)`` adds a function to the process-wide registry.

:class:`AttentionSwitch` is the adapter: it registers its function the first time it is used (importing the package
registers nothing), switches a set of configs to it for the duration of one forward (counted per config, so that
overlapping runs on one model, e.g. from two threads, restore the model's own implementation exactly once), and
reports a config's own implementation also while it is switched.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from torch import nn


def attention_configs(model: nn.Module) -> tuple:
    """The config objects the attention modules read their implementation from (a layer's module has a
    ``layer_idx`` and a ``config``; multimodal models may hold several configs)."""
    configs = {id(m.config): m.config for m in model.modules()
               # transformers' attention modules carry one; other modules do not
               if getattr(m, "layer_idx", None) is not None and hasattr(m, "config")}
    return tuple(configs.values())


class AttentionSwitch:
    """Run ``function`` as the attention implementation of some configs, for one forward at a time."""

    def __init__(self, name: str, function: Callable) -> None:
        self.name, self.function = name, function
        self._registered = False
        self._lock = threading.Lock()
        self._switched: dict[int, list] = {}  # id(config) -> [implementation before the first switch, switches]

    def register(self) -> None:
        """Add the function to transformers' registry (idempotent; the first switch does it)."""
        if not self._registered:
            from transformers import AttentionInterface

            AttentionInterface.register(self.name, self.function)
            self._registered = True

    def original(self, config) -> str | None:
        """The config's own attention implementation, also while this switch has it switched."""
        with self._lock:
            entry = self._switched.get(id(config))
            # a config of the user's: transformers' own field, absent on non-HF configs
            return entry[0] if entry else getattr(config, "_attn_implementation", None)

    @contextmanager
    def on(self, configs: tuple) -> Iterator[None]:
        """Switch ``configs`` to this implementation; undone on exit, even on error."""
        with self._lock:
            self.register()
            for config in configs:
                entry = self._switched.setdefault(id(config), [config._attn_implementation_internal, 0])
                entry[1] += 1
                config._attn_implementation_internal = self.name
        try:
            yield
        finally:
            with self._lock:
                for config in configs:
                    entry = self._switched[id(config)]
                    entry[1] -= 1
                    if entry[1] == 0:
                        config._attn_implementation_internal = entry[0]
                        del self._switched[id(config)]
