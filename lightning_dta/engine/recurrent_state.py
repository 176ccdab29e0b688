"""Recurrent layers' states on the path: the second kind of path state, next to the keys/values of :mod:`.kv`.

``States`` is one tuple per recurrent layer (in layer order) of that layer's state tensors in the order its
:class:`~lightning_dta.engine.layer_kinds.LayerKind` declares them, each with the rows of the batch first (a
convolution window ``[rows, channels, kernel]``, a scan state ``[rows, heads, ...]``).

A node's end state is a function of its parent's end state and its own tokens, so it is handed over exactly like
keys/values: the child gets the parent's state as leaves with ``requires_grad`` (never written in place), its
backward leaves the gradient of its loss in them, those gradients are summed over all the children, and the
parent's own backward at its pop starts from them. :class:`StateLayer` is the engine's cache layer that makes
transformers' mixers work this way: transformers' own ``LinearAttentionLayer`` copies each new state into its
buffer (``copy_``), which cuts the graph, so no gradient would reach the parent. A layer that also attends (kind
``hybrid``: Falcon-H1, Zamba2) gets a :class:`StateAndKVLayer`, the same states next to the path's keys/values, as
transformers' ``LinearAttentionAndFullAttentionLayer`` holds both in one cache layer.

:class:`PathStates` holds the states at the ends of the chunks on the current path, keyed by that end position
(a chunk starting at ``s`` continues from the state stored at ``s``), with their summed gradients.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicLayer

from lightning_dta.engine.errors import ModelNotSupportedError
from lightning_dta.engine.layer_kinds import LayerKind, cache_layer_classes

LinearAttentionCacheLayerMixin, _ = cache_layer_classes()

States = list[tuple[torch.Tensor, ...]]


def _in_place(func) -> bool:
    name = getattr(func, "__name__", "")  # a library's callable: not every one dispatched here has a name
    return (name.endswith("_") and not name.startswith("__")) or name in ("__setitem__", "__iadd__", "__isub__",
                                                                          "__imul__", "__itruediv__")


class HandedState(torch.Tensor):
    """A state as a mixer receives it. transformers' one-token decode paths write the new state into the one they
    read (``mamba2_selective_state_update``: ``state.copy_(new)``), which would overwrite the parent's state and,
    with grad, the very tensor saved for the output's gradient. Here that ``copy_`` writes nothing: it records its
    source as the layer's new state, out of place. Any other in-place operation on it is refused (a mixer the engine
    cannot walk). Every other operation runs on the plain tensor and returns plain tensors, in the graph as usual.

    Kernels that write through a pointer (mamba_ssm's Triton ``selective_state_update`` on CUDA) bypass this; the
    state they fail to hand back through the cache is then refused by :func:`~lightning_dta.engine.forward.
    forward_batch`, never walked wrongly."""

    layer: StateLayer
    state_name: str

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else None
        if isinstance(target, cls) and func is torch.Tensor.copy_:
            target.layer.new[target.state_name] = args[1].to(target.dtype)
            return target
        if isinstance(target, cls) and _in_place(func):
            raise ModelNotSupportedError(
                f"a recurrent mixer ran {func.__name__} in place on the {target.state_name} state the engine handed "
                "it, which would overwrite the parent's state; the tree walk needs every state update out of place. "
                "Fix: mode='vanilla'.")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def of(cls, state: torch.Tensor, layer: StateLayer, name: str) -> HandedState:
        handed = state.as_subclass(cls)
        handed.layer, handed.state_name = layer, name
        return handed


class StateLayer(LinearAttentionCacheLayerMixin):
    """A recurrent layer's cache for one forward: starts from ``initial`` (the path's state, or ``None`` at a
    root) and records the state at the end of the chunk, out of place, without a copy."""

    def __init__(self, kind: LayerKind, initial: tuple[torch.Tensor, ...] | None) -> None:
        super().__init__(number_of_states=1)
        # Every chunk takes the multi-token path of the mixers, also a one-token chunk: their one-token decode
        # path updates the convolution window in place (``causal_conv1d_update``).
        self.record_past = True
        self.kind = kind
        self.new: dict[str, torch.Tensor] = {}
        if initial is not None:
            given = {name: HandedState.of(state, self, name) for name, state in zip(kind.states, initial)}
            self.conv_states[0] = given.get("conv")
            self.recurrent_states[0] = given.get("recurrent")
            self.has_previous_state[0] = True

    def lazy_initialization(self, *args, **kwargs) -> None:  # the states are given, never allocated here
        pass

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, conv_kernel_size: int | None = None,
                          **kwargs) -> torch.Tensor:
        """The window the convolution needs (the previous window, then this chunk's inputs); records the last
        ``conv_kernel_size`` inputs as the new window (zeros before a root's first input, as transformers pads)."""
        previous = self.conv_states[0]
        if conv_kernel_size is None:
            if previous is None:
                raise ModelNotSupportedError(
                    "a recurrent mixer updated its convolution window without its kernel size, which the cache "
                    "contract the engine relies on passes (transformers 5.24). Fix: mode='vanilla'.")
            conv_kernel_size = previous.shape[-1]
        full = conv_states if previous is None else torch.cat([previous.to(conv_states.dtype), conv_states], dim=-1)
        padded = F.pad(full, (max(conv_kernel_size - full.shape[-1], 0), 0))
        self.new["conv"] = padded[..., -conv_kernel_size:]
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        self.new["recurrent"] = recurrent_states
        return recurrent_states

    def final(self) -> tuple[torch.Tensor, ...] | None:
        """The states at the chunk's end in the declared order (``None``: the mixer did not hand over all of them,
        so it bypassed the cache contract)."""
        if set(self.new) != set(self.kind.states):
            return None
        return tuple(self.new[name] for name in self.kind.states)


class StateAndKVLayer(StateLayer, DynamicLayer):
    """The cache layer of a layer that attends and carries recurrent states (its mixer and its attention both index
    the cache by the decoder layer's index): :class:`StateLayer` for the states, ``DynamicLayer`` for the keys and
    values, which the caller pre-fills with the path's. The mask builders see an attention layer (a
    ``CacheLayerMixin``), as with transformers' own cache layer for these layers."""

    def __init__(self, kind: LayerKind, initial: tuple[torch.Tensor, ...] | None) -> None:
        DynamicLayer.__init__(self)
        StateLayer.__init__(self, kind, initial)

    def lazy_initialization(self, *args, **kwargs) -> None:
        """The keys/values' (``update`` passes them positionally); the states are given, never allocated here."""
        if len(args) == 2:
            DynamicLayer.lazy_initialization(self, *args)


def flatten(states: States) -> list[torch.Tensor]:
    return [t for layer in states for t in layer]


def row_states(states: States, row: int) -> States:
    """Row ``row``'s states of a sibling batch (one row each: a model with recurrent layers never packs siblings)."""
    return [tuple(t[row:row + 1] for t in layer) for layer in states]


class PathStates:
    """The recurrent states at the end of each chunk on the path, keyed by that end position, and (for training)
    the gradients the chunks below sent to them."""

    def __init__(self, with_grads: bool = True, required: bool = False) -> None:
        self.with_grads = with_grads
        self.required = required  # the model has recurrent layers: every chunk past a root continues from a state
        self.states: dict[int, States] = {}
        self.state_grads: dict[int, list[torch.Tensor]] = {}

    def write(self, end: int, states: States) -> None:
        """Store a chunk's end state (detached: the chunk's own graph keeps the attached one) with zero gradients."""
        if not states:
            return
        self.states[end] = [tuple(t.detach() for t in layer) for layer in states]
        if self.with_grads:
            self.state_grads[end] = [torch.zeros_like(t) for t in flatten(states)]

    def past(self, start: int, requires_grad: bool) -> tuple[States | None, list[torch.Tensor]]:
        """The state a chunk starting at ``start`` continues from (``None`` at a root) and the leaves whose
        gradients to collect."""
        if start == 0 or not self.required:
            return None, []
        if start not in self.states:  # starting from zeros instead would train on something else, silently
            raise RuntimeError(f"no recurrent state on the path at position {start}; this is a bug in lightning_dta")
        if not requires_grad:  # a copy: a write through a view of a handed state must not reach the path's state
            return [tuple(t.clone() for t in layer) for layer in self.states[start]], []
        # leaves: a write through a view of one fails loudly (autograd refuses in-place writes to leaf views)
        past = [tuple(t.detach().requires_grad_() for t in layer) for layer in self.states[start]]
        return past, flatten(past)

    def collect(self, start: int, leaves: list[torch.Tensor]) -> None:
        """Add the gradients that a backward sent into the state at ``start``."""
        with torch.no_grad():
            for leaf, grad in zip(leaves, self.state_grads.get(start, ())):
                if leaf.grad is not None:
                    grad.add_(leaf.grad)

    def grads(self, end: int) -> list[torch.Tensor]:
        """The summed gradients of the state at ``end`` (flattened like :func:`flatten`; empty: no state)."""
        return self.state_grads.get(end, [])

    def drop(self, end: int) -> None:
        """The chunk that ends at ``end`` is done with its subtree: free its state."""
        self.states.pop(end, None)
        self.state_grads.pop(end, None)
