"""Keys/values of the current root-to-node path, and the gradients that reach them.

One preallocated buffer per layer holds the path's keys (and one its values), positions ``0 .. depth-1``;
a child reads its ancestors as a view ``[:start]`` instead of concatenating their tensors. Gradient buffers
of the same shape collect what every descendant sends back to a position, so a node's backward at pop time
reads the summed gradient of its own keys/values from ``[start:end]``.
"""

from __future__ import annotations

import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]


class PathKV:
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
        """Store a segment's keys/values at ``start..`` and clear the gradients collected there."""
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
        """The prefix ``[1, kv_heads, start, dim]`` per layer for a segment that starts at ``start``, and the leaf
        tensors whose grads to collect.

        The leaves are views of the buffers, which later siblings overwrite beyond ``start`` only; positions
        below ``start`` stay unchanged until the segment is popped.
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
