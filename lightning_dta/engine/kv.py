"""Keys/values: the one ``KV`` type, the recorder of a forward's new keys/values, and the path buffers.

``KV`` is a model's keys/values as one ``(keys, values)`` pair per layer, each ``[rows, kv_heads, length, dim]``.

:class:`KVRecorder` collects the keys/values each layer produces during one forward (after RoPE); both ways of
attending to the prefix (:mod:`~lightning_dta.engine.prefix_attention` and the model's own attention over a
KV cache, :mod:`~lightning_dta.engine.forward`) record into one.

:class:`PathKV` holds the keys/values of the current root-to-node path: one preallocated buffer per layer
for the keys (and one for the values), positions ``0 .. depth-1``. A chunk reads its ancestors as a view
``[:start]`` instead of concatenating their tensors. Gradient buffers of the same shape collect what every
descendant sends back to a position, so a chunk's backward at its pop reads the summed gradient of its own
keys/values from ``[start:end]``.
"""

from __future__ import annotations

import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]


class KVRecorder:
    """The new keys/values of every layer of one forward, in layer order (each layer records once)."""

    def __init__(self) -> None:
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __contains__(self, layer: int) -> bool:
        return layer in self.layers

    def __len__(self) -> int:
        return len(self.layers)

    def record(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.layers[layer] = (keys, values)

    def kv(self) -> KV:
        return [self.layers[i] for i in sorted(self.layers)]


class PathKV:
    """The path's keys/values ``[1, kv_heads, capacity, dim]`` per layer and (for training) their gradients."""

    def __init__(self, capacity: int, with_grads: bool = True) -> None:
        self.capacity = capacity
        self.with_grads = with_grads
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.key_grads: list[torch.Tensor] = []
        self.value_grads: list[torch.Tensor] = []

    def _allocate(self, new_kv: KV) -> None:
        for keys, values in new_kv:
            shape_k = (1, keys.shape[1], self.capacity, keys.shape[3])
            shape_v = (1, values.shape[1], self.capacity, values.shape[3])
            self.keys.append(keys.new_zeros(shape_k))
            self.values.append(values.new_zeros(shape_v))
            if self.with_grads:
                self.key_grads.append(keys.new_zeros(shape_k))
                self.value_grads.append(values.new_zeros(shape_v))

    def write(self, start: int, new_kv: KV) -> None:
        """Store a chunk's keys/values at ``start..`` and clear the gradients collected there."""
        if not new_kv:  # a model without attention layers (a pure state-space model)
            return
        if not self.keys:
            self._allocate(new_kv)
        end = start + new_kv[0][0].shape[2]
        with torch.no_grad():
            for layer, (keys, values) in enumerate(new_kv):
                self.keys[layer][:, :, start:end].copy_(keys)
                self.values[layer][:, :, start:end].copy_(values)
                if self.with_grads:
                    self.key_grads[layer][:, :, start:end].zero_()
                    self.value_grads[layer][:, :, start:end].zero_()

    def past(self, start: int, requires_grad: bool) -> tuple[KV | None, list[torch.Tensor]]:
        """The prefix ``[1, kv_heads, start, dim]`` per layer for a chunk that starts at ``start``, and the leaf
        tensors whose grads to collect.

        The leaves are views of the buffers, which later siblings overwrite beyond ``start`` only; positions
        below ``start`` stay unchanged until the chunk is popped.
        """
        if start == 0 or not self.keys:
            return None, []
        past, leaves = [], []
        for keys, values in zip(self.keys, self.values):
            k, v = keys[:, :, :start], values[:, :, :start]
            if requires_grad:
                k, v = k.detach().requires_grad_(), v.detach().requires_grad_()
                leaves += [k, v]
            past.append((k, v))
        return past, leaves

    def collect(self, start: int, leaves: list[torch.Tensor]) -> None:
        """Add the gradients that a backward sent into the ancestors' keys/values."""
        with torch.no_grad():
            for leaf, grads in zip(leaves, (g for pair in zip(self.key_grads, self.value_grads) for g in pair)):
                if leaf.grad is not None:
                    grads[:, :, :start].add_(leaf.grad)

    def grads(self, start: int, end: int) -> list[torch.Tensor]:
        """The summed gradients of positions ``start..end-1``: keys and values, layer by layer."""
        out = []
        for key_grads, value_grads in zip(self.key_grads, self.value_grads):
            out += [key_grads[:, :, start:end], value_grads[:, :, start:end]]
        return out
