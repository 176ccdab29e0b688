"""The device self-check of recurrent mixers' kernels: no one trains a hybrid on a kernel whose state gradient has
not been checked on this device.

On CUDA, transformers' recurrent mixers call fla's ``chunk_gated_delta_rule``, ``causal_conv1d`` and mamba_ssm's
chunk scan when those packages are installed, and their pure-PyTorch functions otherwise (transformers 5.24's
``use_kernel_func_from_hub_with_fallback`` wraps each function of a modeling module: the wrapper calls the package's
kernel where it imports, and keeps the pure-PyTorch function as its ``__wrapped__``). The tree walk hands each
node's end state to its children and needs the gradient their backward sends to that *initial* state: a kernel
that drops it (or mishandles the final state's gradient) still returns outputs of the right shape and trains the
parent's recurrent layers on part of their gradient, silently.

So once per (mixer class, device, dtype), at the first walk of a hybrid on CUDA, one mixer of each class runs a chunk
of several tokens and a chunk of one (the decode kernels a node of one token runs) from a state (the state a first
chunk left, as in the walk) through the model's path and through the pure-PyTorch path, and their outputs, final
states and the gradients of both w.r.t. the chunk's input, its initial states and the mixer's parameters are compared.
A difference beyond the dtype's tolerance, or a kernel that raises, is a verdict: reported with the measured figure,
and every kernel function of that mixer's modeling module is replaced by its pure-PyTorch function for the rest of the
process (exact, slower; HF generation in the same process then runs it too). An error of the check itself (out of
memory, or the pure-PyTorch side raising) is no verdict: it warns, nothing falls back, and the check runs again at the
next walk.
"""

from __future__ import annotations

import inspect
import math
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn
from transformers import DynamicCache

from lightning_dta.engine.device import expected_sync, to_device
from lightning_dta.engine.layer_kinds import LAYER_KINDS, LayerKind, cache_layer_classes
from lightning_dta.engine.recurrent_state import StateLayer

# Largest relative difference (Frobenius norm) from the pure-PyTorch path, per tensor. The kernels compute in other
# orders (and Triton kernels may take TF32 dot products in float32); a dropped initial-state gradient is 1.0 (zeros
# against the true gradient), a gradient sent to the wrong head or position O(1).
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-2, torch.float16: 5e-2, torch.bfloat16: 5e-2}
FIRST = 11  # the first chunk's tokens: it leaves the state the checked chunks start from
# The checked chunks, by the prefix of their figures' names: one of several tokens, and one of a single token, which
# the mixers run through their decode kernels (fla's fused_recurrent_*, causal-conv1d's update: a node of one token)
CHECKED_CHUNKS = {"": 29, "one-token ": 1}


class RecurrentKernelWarning(RuntimeWarning):
    """A recurrent mixer's kernels disagreed with its pure-PyTorch path on this device, so that path is used instead;
    or the check could not run (no verdict: nothing changes)."""


class CheckNotRun(RuntimeError):
    """The pure-PyTorch side of the check raised: no verdict on the kernels (the check runs again next time)."""


@dataclass(frozen=True)
class Figure:
    """One measured difference: a tensor of the checked chunk, relative to the pure-PyTorch path."""

    tensor: str
    error: float


_CHECKED: dict[tuple, str | None] = {}


def kernel_functions(module: ModuleType) -> dict[str, Callable]:
    """The functions of a modeling module that may run a package's kernel: transformers' wrappers, each keeping the
    pure-PyTorch function it falls back to as ``__wrapped__`` (a function of the same module)."""
    found = {}
    for name, value in vars(module).items():
        # transformers' kernel wrapper keeps the pure-PyTorch function (functools.wraps); other callables lack it
        fallback = getattr(value, "__wrapped__", None)
        if inspect.isfunction(fallback) and fallback is not value and fallback.__module__ == module.__name__:
            found[name] = value
    return found


def pure_pytorch(module: ModuleType) -> dict[str, Callable]:
    """Replace every kernel function of ``module`` by its pure-PyTorch function; returns what it replaced."""
    replaced = kernel_functions(module)
    for name, value in replaced.items():
        setattr(module, name, value.__wrapped__)
    return replaced


def restore(module: ModuleType, replaced: dict[str, Callable]) -> None:
    """Put back what :func:`pure_pytorch` replaced."""
    for name, value in replaced.items():
        setattr(module, name, value)


def mixers(model: nn.Module, kinds: tuple[str, ...]) -> dict[type, nn.Module]:
    """One recurrent mixer per class (the module that carries a recurrent ``layer_type``, as transformers' do)."""
    recurrent = {kind for kind in kinds if LAYER_KINDS[kind].states}
    found: dict[type, nn.Module] = {}
    for module in model.modules():
        # transformers' recurrent mixers carry their layer's kind; other modules do not
        if getattr(module, "layer_type", None) in recurrent:
            found.setdefault(type(module), module)
    return found


def check_recurrent_kernels(model: nn.Module, kinds: tuple[str, ...], device: torch.device,
                            dtype: torch.dtype) -> dict[str, str]:
    """Check one mixer of each recurrent class of ``model`` (module docstring); returns the verdicts that made a
    mixer class fall back to its pure-PyTorch path, by class name (empty: every kernel agreed). Cached per
    (mixer class, device, dtype); a verdict warns once."""
    config = getattr(model, "config", None)  # a Hugging Face model's config (its mixers read the same field)
    hidden_size = (config.get_text_config() if hasattr(config, "get_text_config") else config).hidden_size
    verdicts = {}
    for cls, mixer in mixers(model, kinds).items():
        key = (cls, str(device), dtype)
        if key not in _CHECKED:
            try:
                _CHECKED[key] = _check_one(mixer, LAYER_KINDS[mixer.layer_type], hidden_size, device, dtype)
            except (CheckNotRun, torch.OutOfMemoryError) as error:  # no verdict: the check runs again next time
                _warn(f"could not run the self-check of {cls.__name__}'s kernels on {device} {dtype} "
                      f"({type(error).__name__}: {error}); this is no verdict, the check runs again at the next walk")
                continue
        if _CHECKED[key]:
            verdicts[cls.__name__] = _CHECKED[key]
    return verdicts


def _check_one(mixer: nn.Module, kind: LayerKind, hidden_size: int, device: torch.device, dtype: torch.dtype
               ) -> str | None:
    """The verdict on one mixer's kernels (``None``: they agree, or there are none); a failing one falls back."""
    module = sys.modules[type(mixer).__module__]
    functions = sorted(kernel_functions(module))
    if not functions:  # nothing but PyTorch to run
        return None
    name = type(mixer).__name__
    try:
        reason = verdict(name, functions, device, dtype, measure(mixer, kind, hidden_size, device, dtype))
    except (CheckNotRun, torch.OutOfMemoryError):
        raise
    except Exception as error:  # the model's path raised where the pure-PyTorch path did not: a verdict
        reason = f"{name}'s kernels ({', '.join(functions)}) failed on {device} {dtype} ({type(error).__name__}: " \
                 f"{error})"
    if reason is None:
        return None
    pure_pytorch(module)
    return _warn(f"{reason}. The tree walk needs the gradient each chunk sends to its initial state; {name} now runs "
                 f"its pure-PyTorch functions in this process (exact, slower). Fix: install fla / causal-conv1d / "
                 "mamba_ssm releases whose kernels pass, or report the figures above")


def verdict(name: str, functions: list[str], device: torch.device, dtype: torch.dtype, figures: list[Figure]
            ) -> str | None:
    """Why the kernel path must not be used given its measured ``figures`` (``None``: all within tolerance)."""
    limit = TOLERANCE.get(dtype, TOLERANCE[torch.bfloat16])
    worst = max(figures, key=lambda f: f.error)
    if worst.error <= limit:
        return None
    return (f"{name}'s kernels ({', '.join(functions)}) differ from its pure-PyTorch path on {device} {dtype} by "
            f"{worst.error:.2e} relative ({worst.tensor}; tolerance {limit:.0e})")


def _warn(reason: str) -> str:
    warnings.warn(reason, RecurrentKernelWarning, stacklevel=4)
    return reason


def _cache(mixer: nn.Module, layer: StateLayer) -> DynamicCache:
    """A cache whose layer at the mixer's index is ``layer`` (layers before it hold nothing)."""
    _, dummy_layer = cache_layer_classes()
    cache = DynamicCache()
    cache.layers = [dummy_layer() for _ in range(mixer.layer_idx)] + [layer]
    return cache


def _chunk(mixer: nn.Module, kind: LayerKind, hidden: torch.Tensor, initial: tuple[torch.Tensor, ...] | None
           ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The mixer's output and final states for one chunk from ``initial`` (``None``: a root)."""
    layer = StateLayer(kind, initial)
    out = mixer(hidden, cache=_cache(mixer, layer))
    final = layer.final()
    if final is None:
        raise RuntimeError(f"{type(mixer).__name__} did not hand its new states to the cache")
    return out, final


def measure(mixer: nn.Module, kind: LayerKind, hidden_size: int, device: torch.device, dtype: torch.dtype
            ) -> list[Figure]:
    """Relative difference of the model's path from the pure-PyTorch path, per tensor of each checked chunk
    (:data:`CHECKED_CHUNKS`): its output and final states, and the gradients (of a random linear function of both)
    w.r.t. its input, its initial states and the mixer's own parameters. Raises what the model's path raised, and
    :class:`CheckNotRun` where the pure-PyTorch path raised."""
    module = sys.modules[type(mixer).__module__]
    gen = torch.Generator().manual_seed(0)

    def rand(*size: int) -> torch.Tensor:  # drawn on the host: the same figures on every device
        return to_device(torch.randn(*size, generator=gen, dtype=torch.float64).to(dtype), device)

    named = [(n, p) for n, p in mixer.named_parameters() if p.requires_grad and type(p) in (torch.Tensor, nn.Parameter)]
    params = [p for _, p in named]
    first = rand(1, FIRST, hidden_size)
    checked = {prefix: rand(1, tokens, hidden_size) for prefix, tokens in CHECKED_CHUNKS.items()}
    with expected_sync(device), torch.inference_mode(False), torch.enable_grad(), \
            torch.autocast(device.type, enabled=False):
        replaced = pure_pytorch(module)
        try:
            with torch.no_grad():
                _, start = _chunk(mixer, kind, first, None)
            want = {prefix: _run(mixer, kind, hidden, start, params, gen) for prefix, hidden in checked.items()}
        except torch.OutOfMemoryError:
            raise
        except Exception as error:
            raise CheckNotRun(f"the pure-PyTorch path raised {type(error).__name__}: {error}") from error
        finally:
            restore(module, replaced)
        got = {prefix: _run(mixer, kind, hidden, start, params, gen) for prefix, hidden in checked.items()}
    names = ["output", *(f"final {s} state" for s in kind.states), "input gradient",
             *(f"initial {s} state gradient" for s in kind.states), *(f"{n} gradient" for n, _ in named)]
    return [Figure(prefix + n, _relative(g, w)) for prefix in checked
            for n, g, w in zip(names, (*got[prefix][0], *got[prefix][1]), (*want[prefix][0], *want[prefix][1]))]


def _run(mixer: nn.Module, kind: LayerKind, hidden: torch.Tensor, start: tuple[torch.Tensor, ...],
         params: list[torch.Tensor], gen: torch.Generator) -> tuple[tuple, tuple]:
    """One chunk from leaves holding ``start``: (output and final states, their gradients w.r.t. input, initial
    states and ``params`` for cotangents drawn from ``gen`` reseeded to 1)."""
    gen.manual_seed(1)
    hidden = hidden.detach().requires_grad_()
    initial = tuple(t.detach().clone().requires_grad_() for t in start)
    out, final = _chunk(mixer, kind, hidden, initial)
    outputs = (out, *final)
    cotangents = [to_device(torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.dtype), t.device)
                  for t in outputs]
    # an output cut from the graph (a kernel that detaches its final state) sends no gradient: measured, not raised
    attached = [(t, c) for t, c in zip(outputs, cotangents) if t.requires_grad]
    grads = torch.autograd.grad([t for t, _ in attached], (hidden, *initial, *params), [c for _, c in attached],
                                allow_unused=True)
    grads = tuple(torch.zeros_like(x) if g is None else g for g, x in zip(grads, (hidden, *initial, *params)))
    return tuple(t.detach() for t in outputs), grads


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    error = float((got - want).norm() / want.norm().clamp_min(1e-30))
    return math.inf if math.isnan(error) else error
