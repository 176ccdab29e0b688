"""Parallelizing a causal LM for tree walks, where Lightning puts it: in the module's ``configure_model``.

Lightning's ``ModelParallelStrategy`` convention (and torchtitan's ``parallelize``: ``apply_tp``, then ``apply_fsdp``):
the strategy builds the device mesh and the module parallelizes itself from it. :func:`parallelize_model` is the one
function a module calls. It reads the :class:`~lightning_dta.contracts.ParallelLayout` the strategy offers and
applies, in this order:

1. tensor parallelism over the mesh's ``tensor_parallel`` dimension
   (:func:`~lightning_dta.distributed.tensor_parallel.tensor_parallel`: the model's own transformers plan as torch
   styles; the peers of a group walk the same tree);
2. FSDP2 over its ``data_parallel`` dimension (each decoder layer, then the root; every data-parallel rank walks its
   own tree: gather once, reduce once, :mod:`~lightning_dta.distributed.sharding`);
3. for a model built on the meta device: allocation on the device and the checkpoint loaded into the shards, so no
   rank ever holds the whole model.

The layout is kept on the model, so that a frozen copy (a reference policy) is parallelized the same way
(:func:`~lightning_dta.distributed.sharding.sharded_copy`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from lightning_dta.contracts import DATA_PARALLEL, TENSOR_PARALLEL, ParallelLayout
from lightning_dta.distributed.sharding import (
    ShardingError,
    is_sharded,
    load_hf_checkpoint,
    materialize,
    parallel_copy_recipe,
    shard,
)
from lightning_dta.distributed.tensor_parallel import tensor_parallel


def parallelize_model(model: nn.Module, layout: ParallelLayout, device: torch.device,
                      checkpoint: str | Path | None = None) -> nn.Module:
    """Parallelize ``model`` as ``layout`` asks (nothing to do when it replicates the weights or ``model`` is
    parallelized already); a model on the meta device is allocated on ``device`` and loaded from the Hugging Face
    ``checkpoint`` (a local directory) into its shards."""
    if (layout.sharding is None and layout.tensor_parallelism is None) or is_sharded(model) \
            or parallel_copy_recipe(model) is not None:
        return model
    on_meta = any(p.is_meta for p in model.parameters())
    buffers = {name: b for name, b in model.named_buffers() if not b.is_meta}
    apply_layout(model, layout)
    if on_meta:
        if checkpoint is None:
            raise ShardingError("the model was built on the meta device but there is no checkpoint to load into its "
                                "shards. Fix: give DTAModule a local checkpoint path or a hub name")
        materialize(model, device, buffers)
        load_hf_checkpoint(model, checkpoint)
    return model


def apply_layout(model: nn.Module, layout: ParallelLayout) -> nn.Module:
    """Steps 1 and 2 of the module docstring (on real or meta parameters), and the layout kept on the model."""
    if layout.device_mesh is None:
        raise ShardingError("the layout parallelizes the weights but carries no device mesh. Fix: parallelize in "
                            "configure_model, once the strategy has set up its environment")
    sharding, tensor = layout.sharding, layout.tensor_parallelism
    if sharding is not None and sharding.param_dtype is not None:
        model.to(dtype=sharding.param_dtype)
    if tensor is not None and tensor.size > 1:
        tensor_parallel(model, layout.device_mesh[TENSOR_PARALLEL], vocab_parallel=tensor.vocab_parallel,
                        plan_overrides=dict(tensor.plan_overrides))
    if sharding is not None:
        shard(model, layout.device_mesh[DATA_PARALLEL], mp_policy=sharding.mp_policy,
              reshard_after_forward=sharding.reshard_after_forward, offload=sharding.offload,
              wrap_modules=sharding.wrap_modules)
    model._lightning_dta_layout = layout  # for sharded_copy: a copy is parallelized the same way
    return model
