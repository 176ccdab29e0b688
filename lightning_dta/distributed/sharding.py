"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for DFS training: shard, run an engine call, reduce, gather, load.

Why the engine needs more than ``fully_shard``. FSDP2 all-gathers a unit's parameters before each forward and
reduce-scatters its gradients after each backward. Those are collectives: every rank must issue them in the same
order. A DFS step runs one forward per sibling batch and one backward per pop, and every rank walks its own tree,
so the ranks issue different numbers of them and the run hangs (measured: a reduce-scatter timeout on 2 gloo
ranks with trees of 5 and 7 backwards). So an engine call on a sharded model runs inside :func:`unsharded`:

1. every unit is all-gathered once, the same on every rank (one all-gather per unit);
2. during the walk FSDP issues no collective at all: parameters stay unsharded
   (``reshard_after_forward/backward=False``) and gradients accumulate unsharded
   (``set_requires_gradient_sync(False)``), whatever each rank's tree;
3. training only: :func:`reduce_gradients` runs one zero-weighted backward of one token with gradient sync on, on
   every rank: FSDP reduce-scatters each unit's accumulated gradient once (a SUM: every rank already divided its
   loss by the whole step's normaliser), and reshards.

Afterwards every unit has its own ``reshard_after_forward`` back, so a forward outside a step (validation, a
callback) reshards as the model was sharded to.

The alternative, a reduce-scatter after every backward, needs the same number of backwards on every rank
(``docs/lightning.md`` has the measured trade). It saves the unsharded gradient buffer but sends a unit's
gradient once per pop instead of once per step; BENCHMARKS.md counts both.

Also here: sharding a Hugging Face model (each decoder layer and the root), building it on the meta device and
loading a local Hugging Face checkpoint into the shards (``torch.distributed.checkpoint.HuggingFaceStorageReader``:
every rank reads only its slices), exporting a plain Hugging Face checkpoint from the shards
(``HuggingFaceStorageWriter``), gathering full parameters one at a time (the generator's weight refresh), and
counting the bytes each rank holds.
"""

from __future__ import annotations

import contextlib
import copy
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from lightning_dta.core.errors import UsageError
from lightning_dta.distributed.collectives import mesh_device

try:  # FSDP2 (torch >= 2.4); the package works without it (``dta`` replicates)
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch without distributed
    FSDPModule = MixedPrecisionPolicy = fully_shard = DTensor = None


class ShardingError(UsageError, TypeError):
    """A model or set-up that sharded training cannot run exactly; the message says what to change."""


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules ``fully_shard`` was applied to, parents before children (root first)."""
    return [m for m in model.modules() if FSDPModule is not None and isinstance(m, FSDPModule)]


def is_sharded(model: nn.Module) -> bool:
    return bool(fsdp_units(model))


def decoder_layers(model: nn.Module, wrap_modules: Sequence[str] | None = None) -> list[nn.Module]:
    """The modules to shard one by one: instances of the classes named in ``wrap_modules``, or of the model's own
    ``_no_split_modules`` (Hugging Face lists its decoder layer class there, e.g. ``LlamaDecoderLayer``)."""
    # a Hugging Face model lists its repeated block class here; other modules may not
    names = set(wrap_modules or getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names and m is not model]
    if not layers:
        raise ShardingError(
            f"found no decoder layers to shard in {type(model).__name__} (looked for "
            f"{sorted(names) or 'its _no_split_modules, which it does not declare'}). Fix: "
            "DTAFSDPStrategy(wrap_modules=['MyDecoderLayer']) with the class name of the model's repeated block")
    return layers


def shard(model: nn.Module, mesh, *, mp_policy: MixedPrecisionPolicy | None = None,
          reshard_after_forward: bool = True, offload: bool = False,
          wrap_modules: Sequence[str] | None = None) -> nn.Module:
    """``fully_shard`` each decoder layer, then the root, over the 1-D data-parallel ``mesh``; gradients are summed
    over ranks (not averaged: each rank's loss is already divided by the whole step's normaliser)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    kwargs = dict(mesh=mesh, reshard_after_forward=reshard_after_forward,
                  offload_policy=CPUOffloadPolicy() if offload else OffloadPolicy())
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    for layer in decoder_layers(model, wrap_modules):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    sum_over_ranks(model)
    return model


def _empty_like(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """A model of the same architecture: parameters on the meta device, buffers copied (real)."""
    from lightning_dta.models import causal_lm_on_meta

    config = copy.deepcopy(model.config)  # never shared: the attention switch edits a config during a forward
    empty = causal_lm_on_meta(config, dtype=dtype or config.dtype)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            module_name, _, buffer_name = name.rpartition(".")
            (empty.get_submodule(module_name) if module_name else empty)._buffers[buffer_name] = buffer.clone()
    return empty


def parallel_copy_recipe(model: nn.Module):
    """How ``model`` was parallelized (a :class:`~lightning_dta.contracts.ParallelLayout`, kept by
    :func:`~lightning_dta.distributed.parallelize.parallelize_model`), or ``None``."""
    # set by parallelize_model: a model parallelized elsewhere has none
    return getattr(model, "_lightning_dta_layout", None)


def sharded_copy(model: nn.Module) -> nn.Module:
    """A frozen copy of a sharded model, parallelized the same way (FSDP2 refuses ``copy.deepcopy``): built on the
    meta device, parallelized with ``model``'s layout and given ``model``'s shards (a local copy, no communication)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from lightning_dta.distributed.parallelize import apply_layout  # it imports this module

    layout = parallel_copy_recipe(model)
    if layout is None:
        raise ShardingError("this model was parallelized outside lightning_dta.parallelize_model, so its sharding "
                            "cannot be repeated for a copy. Fix: parallelize it with lightning_dta.parallelize_model")
    device = compute_device(model)
    buffers = dict(model.named_buffers())
    frozen = apply_layout(_empty_like(model, next(model.parameters()).dtype), layout)
    materialize(frozen, device, buffers)
    set_model_state_dict(frozen, get_model_state_dict(model))
    return frozen.requires_grad_(False).eval()


def compute_device(model: nn.Module) -> torch.device:
    """The device ``model`` computes on: a sharded model's mesh device (under CPU offload its shards live in CPU
    memory between uses), else the device of its parameters."""
    first = next(model.parameters())
    return mesh_device(first.device_mesh) if DTensor is not None and isinstance(first, DTensor) else first.device


def unsharded_copy(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """An ordinary (unsharded) copy of a sharded model on its compute device, e.g. for a generator: parameters
    gathered one at a time (a collective: every rank calls it), cast to ``dtype`` (default the dtype of the shards)."""
    device = compute_device(model)
    dtype = dtype or next(model.parameters()).dtype
    empty = _empty_like(model, dtype)
    empty.to_empty(device=device)
    empty.tie_weights()  # to_empty gives each module a new parameter: a tied head would be one of its own
    copy_weights(model, empty)
    return empty.requires_grad_(False)


def copy_weights(source: nn.Module, target: nn.Module) -> None:
    """Copy ``source``'s parameters and buffers (sharded or not: gathered one at a time) into the same-named
    tensors of the unsharded ``target``, in ``target``'s dtypes."""
    mine = dict(target.named_parameters()) | dict(target.named_buffers())
    theirs = {n for n, _ in [*source.named_parameters(), *source.named_buffers()]}
    if theirs != set(mine):
        raise ValueError(f"the models have different parameters (e.g. {sorted(theirs ^ set(mine))[:5]}); "
                         "give a copy of the same architecture")
    with torch.no_grad():
        for name, full in full_parameters(source):
            mine[name].copy_(full)


def sum_over_ranks(model: nn.Module) -> None:
    """Make FSDP sum gradients over ranks instead of averaging them (each rank's loss is already divided by the
    whole step's normaliser), with a plain SUM (gloo has no pre-multiplied sum)."""
    for unit in fsdp_units(model):
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)


@contextlib.contextmanager
def unsharded(model: nn.Module, training: bool = True) -> Iterator[None]:
    """Run one engine call with every FSDP unit unsharded and no FSDP collective inside (module docstring). Every
    rank must enter it, also a rank without a tree. A no-op for an unsharded model."""
    units = fsdp_units(model)
    if not units:
        yield
        return
    root = units[0]
    root.set_reshard_after_backward(False)
    root.set_requires_gradient_sync(False)
    with _kept_unsharded_after_forward(units):
        for unit in units:
            unit.unshard()
        try:
            yield
        finally:
            root.set_requires_gradient_sync(True)
            root.set_reshard_after_backward(True)
            if not training:
                for unit in units:
                    unit.reshard()


@contextlib.contextmanager
def _kept_unsharded_after_forward(units: list[nn.Module]) -> Iterator[None]:
    """Switch FSDP2's reshard-after-forward off on every unit for the block, then put back each unit's own setting.

    The setting must come back: a forward outside a step (validation, a callback, generation) would otherwise keep
    a full replica of every unit on every rank. It is saved and restored per unit, since a child may differ from the
    root (an int reshards to a smaller group; FSDP2 keeps a root unsharded after forward when it chose the root's
    setting itself). ``set_reshard_after_forward`` has no getter, so the state behind it is saved: each parameter
    group's post-forward mesh, and whether FSDP2 chooses the setting (its root rule is applied again on restore: the
    root may have been found, by its first forward, inside the block)."""
    states = [unit._get_fsdp_state() for unit in units]
    # FSDP2's private state (no public getter); its names differ between torch releases (_param_groups)
    saved = [(getattr(state, "_auto_reshard_after_forward", None),
              [group.post_forward_mesh_info for group in _param_groups(state)]) for state in states]
    units[0].set_reshard_after_forward(False)  # every unit (recursive)
    try:
        yield
    finally:
        for state, (auto, meshes) in zip(states, saved):
            if auto is not None:
                state._auto_reshard_after_forward = auto
            for group, mesh in zip(_param_groups(state), meshes):
                group.post_forward_mesh_info = None if auto and state._is_root else mesh


def _param_groups(state) -> list:
    """An FSDP2 unit's parameter groups: ``_fsdp_param_groups`` in torch >= 2.12, one ``_fsdp_param_group`` (or
    ``None``) before (the device image's torch 2.11; ``benchmarks/gpu_requirements.py`` checks that one of them is
    there)."""
    # torch >= 2.12's name; the device image's 2.11 has the single group below
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = state._fsdp_param_group
    return [] if group is None else [group]


def reduce_gradients(model: nn.Module) -> None:
    """After :func:`unsharded` (training): reduce-scatter every unit's accumulated gradient once, then reshard. One
    zero-weighted backward of one token on every rank makes FSDP run its own reduction; it adds exactly zero."""
    units = fsdp_units(model)
    if not units:
        return
    root = units[0]
    root.set_requires_gradient_sync(True)
    root.set_reshard_after_backward(True)
    device = compute_device(model)
    # still unsharded from the walk: resharding after this forward would all-gather every unit again for its backward
    with _kept_unsharded_after_forward(units), torch.enable_grad():
        logits = model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False).logits
        (logits.float().sum() * 0.0).backward()
    for unit in units:
        unit.reshard()


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded tensor (the tensor itself when it is not sharded)."""
    return tensor.to_local() if DTensor is not None and isinstance(tensor, DTensor) else tensor


def full_parameters(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` for every parameter and buffer, one at a time: a sharded one is all-gathered (a
    collective: every rank must iterate, in the same order) and freed before the next, so no rank ever holds more
    than one full tensor besides its shards. Full tensors are on the mesh's device (the compute device)."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if DTensor is not None and isinstance(tensor, DTensor):
            device = mesh_device(tensor.device_mesh)  # CPU offload: the shard is in CPU memory, the gather on the mesh
            tensor = (tensor if tensor.device == device else tensor.to(device)).full_tensor()
        yield name, tensor


def state_bytes(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer] = ()) -> dict[str, int]:
    """The bytes of parameters, gradients and optimizer state this rank holds (storage of its shards, not RSS)."""

    def size(t: torch.Tensor) -> int:
        local = local_tensor(t)
        return local.numel() * local.element_size()

    params = [p for p in model.parameters()]
    counts = {"parameters": sum(size(p) for p in params),
              "gradients": sum(size(p.grad) for p in params if p.grad is not None),
              "optimizer": sum(size(v) for opt in optimizers for state in opt.state.values()
                               for v in state.values() if isinstance(v, torch.Tensor))}
    counts["total"] = sum(counts.values())
    return counts


def materialize(model: nn.Module, device: torch.device, buffers: dict[str, torch.Tensor]) -> None:
    """Allocate a meta-initialised, sharded model on ``device`` (uninitialised) and put back its buffers (built
    real at init: ``to_empty`` would leave RoPE frequencies as garbage)."""
    model.to_empty(device=device)
    with torch.no_grad():
        for name, value in buffers.items():
            module_name, _, buffer_name = name.rpartition(".")
            module = model.get_submodule(module_name) if module_name else model
            module._buffers[buffer_name] = value.to(device)


def load_hf_checkpoint(model: nn.Module, path: str | Path) -> None:
    """Load a local Hugging Face checkpoint (safetensors) into the sharded ``model``: every rank reads only the
    slices of its own shards, so no rank holds the whole model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    state = get_model_state_dict(model)
    tied = _tied_keys(model, state)
    wanted = {k: v for k, v in state.items() if k not in tied}
    dcp.load(wanted, storage_reader=HuggingFaceStorageReader(str(path)))
    set_model_state_dict(model, wanted, options=_non_strict())


def export_hf_checkpoint(model: nn.Module, out_dir: str | Path) -> Path:
    """Write ``model`` (sharded or not) as a plain Hugging Face checkpoint (``config.json`` + safetensors), loadable
    with ``AutoModelForCausalLM.from_pretrained``. Every rank calls it; each writes its shards, which rank 0 then
    consolidates into the ``save_pretrained`` layout. Tied weights are written once, as ``save_pretrained`` does."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if not is_sharded(model):
        if rank == 0:
            model.save_pretrained(out)
        return out
    state = get_model_state_dict(model, options=StateDictOptions(cpu_offload=False))
    tied = _tied_keys(model, state)
    state = {k: v for k, v in state.items() if k not in tied}
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(str(out), save_distributed=True,
                                                            enable_consolidation=True))
    if rank == 0:
        model.config.save_pretrained(out)
        # optional Hugging Face attribute: not every model has a generation config
        generation = getattr(model, "generation_config", None)
        if generation is not None:
            generation.save_pretrained(out)
        shutil.rmtree(out / "sharded", ignore_errors=True)  # the per-rank files the consolidation read
    if dist.is_initialized():
        dist.barrier()
    return out


def _tied_keys(model: nn.Module, state: dict[str, torch.Tensor]) -> set[str]:
    """State-dict keys that alias another parameter (``lm_head.weight`` tied to the embeddings)."""
    # optional Hugging Face attribute: the keys that alias another parameter, where any
    tied = getattr(model, "_tied_weights_keys", None) or ()
    if isinstance(tied, dict):
        tied = tied.keys()
    # a user's model: not every nn.Module carries a Hugging Face config
    config = getattr(model, "config", None)
    # optional config field: not every model family has it
    if config is not None and not getattr(config, "tie_word_embeddings", False):
        return set()
    return {k for k in tied if k in state}


def _non_strict():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(strict=False)
