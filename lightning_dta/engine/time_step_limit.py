"""Mamba2 mixers' one-token update, with the time-step limit their chunk scan applies.

transformers' Mamba2 mixers (Mamba2, Nemotron-H, Bamba, Granite-4 hybrid, Falcon-H1, Zamba2) clamp each time step
``softplus(dt + dt_bias)`` to the mixer's ``time_step_limit`` in their chunk scan, which every chunk of two or more
tokens runs, and so does training each rollout alone. A chunk of one token continued from a state runs their
one-token update instead, ``mamba2_selective_state_update`` of the mixer's modeling module, which takes no limit:
where a time step falls below the limit, that token's output and end state are another function. Nemotron-H and
Zamba2 set the limit to ``(time_step_min, inf)`` (0.001 by default; the others' is ``(0, inf)``, which a softplus
never leaves). The tree walk runs one-token chunks wherever a node has one token or a chunk boundary leaves one:
measured on a tiny float64 Zamba2 against training each rollout alone, per-parameter gradients were off by up to
2.5e-4 relative through the tree's own one-token nodes and 4.8e-2 with chunks of one token (3.4e-5 and 5.2e-3 at its
initial weights' scale).

So, during the engine's forwards of a model with such mixers, :func:`clamped_one_token_updates` puts a wrapper in
place of that function in their modeling modules: it computes the time step as the chunk scan does (bias, softplus,
clamp) and hands it to the function it replaced with ``dt_softplus=False`` and no bias, so the kernel or pure-PyTorch
function that runs is unchanged otherwise. The limits are read per context, so that a generation running outside
the engine's forwards (another thread) keeps the model's own update.
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from lightning_dta.engine.errors import ModelNotSupportedError

ONE_TOKEN_UPDATE = "mamba2_selective_state_update"

Limits = tuple[tuple[str, tuple[float, float]], ...]  # (modeling module's name, limit) per module

_LIMITS: ContextVar[Limits] = ContextVar("lightning_dta_time_step_limits", default=())
_LOCK = threading.Lock()
_INSTALLED: dict[str, list] = {}  # module name -> [the function replaced, contexts using the wrapper]


def active_limit(mixer: nn.Module) -> tuple[float, float] | None:
    """A Mamba2 mixer's time-step limit where it can bind (other than ``(0, inf)``), else ``None``."""
    # a Mamba2 mixer's attribute; other mixers have none
    limit = getattr(mixer, "time_step_limit", None)
    if limit is None or (limit[0] <= 0.0 and limit[1] == math.inf):
        return None
    return (float(limit[0]), float(limit[1]))


def time_step_limits(model_name: str, mixers: list[nn.Module]) -> Limits:
    """The limit of each modeling module whose mixers have one (refused: one the engine cannot apply)."""
    limits: dict[str, tuple[float, float]] = {}
    for mixer in mixers:
        limit = active_limit(mixer)
        if limit is None:
            continue
        module_name = type(mixer).__module__
        module = sys.modules[module_name]
        if not callable(getattr(module, ONE_TOKEN_UPDATE, None)):
            raise ModelNotSupportedError(
                f"{model_name}'s recurrent mixer {type(mixer).__name__} clamps its time steps to {limit} in its chunk "
                f"scan, and its module {module_name} has no {ONE_TOKEN_UPDATE} through which the engine applies the "
                "same limit to a chunk of one token: such a chunk would compute another function than training each "
                "rollout alone. Fix: mode='vanilla'.")
        if limits.setdefault(module_name, limit) != limit:
            raise ModelNotSupportedError(
                f"{model_name}'s recurrent mixers of {module_name} clamp their time steps to different limits "
                f"({limits[module_name]} and {limit}); the engine applies one limit per modeling module to chunks of "
                "one token. Fix: mode='vanilla'.")
    return tuple(sorted(limits.items()))


def _clamping(module_name: str, update: Callable) -> Callable:
    """``update`` with the time step computed as the chunk scan does, where this context set a limit."""

    def clamped(state, hidden_states, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False, z=None, **kwargs):
        limit = dict(_LIMITS.get()).get(module_name)
        if limit is not None:
            if dt_bias is not None:
                dt = dt + dt_bias.to(dt.dtype)
            if dt_softplus:
                dt = F.softplus(dt)
            dt, dt_bias, dt_softplus = torch.clamp(dt, min=limit[0], max=limit[1]), None, False
        return update(state, hidden_states, dt, A, B, C, D, dt_bias=dt_bias, dt_softplus=dt_softplus, z=z, **kwargs)

    clamped.__name__ = clamped.__qualname__ = f"{ONE_TOKEN_UPDATE}_with_time_step_limit"
    return clamped


@contextmanager
def clamped_one_token_updates(limits: Limits) -> Iterator[None]:
    """Apply ``limits`` (:func:`time_step_limits`) to the one-token updates of their modules while in the context;
    undone on exit, even on error (counted per module, so that overlapping contexts restore it once)."""
    if not limits:
        yield
        return
    with _LOCK:
        for module_name, _ in limits:
            module: ModuleType = sys.modules[module_name]
            entry = _INSTALLED.setdefault(module_name, [getattr(module, ONE_TOKEN_UPDATE), 0])
            if entry[1] == 0:
                setattr(module, ONE_TOKEN_UPDATE, _clamping(module_name, entry[0]))
            entry[1] += 1
    token = _LIMITS.set(tuple({**dict(_LIMITS.get()), **dict(limits)}.items()))
    try:
        yield
    finally:
        _LIMITS.reset(token)
        with _LOCK:
            for module_name, _ in limits:
                entry = _INSTALLED[module_name]
                entry[1] -= 1
                if entry[1] == 0:
                    setattr(sys.modules[module_name], ONE_TOKEN_UPDATE, entry[0])
                    del _INSTALLED[module_name]
