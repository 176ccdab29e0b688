"""Parallelizing a causal LM for tree walks, where Lightning puts it: in the module's ``configure_model``.

Lightning's ``ModelParallelStrategy`` convention (and torchtitan's ``parallelize``): the strategy builds the device
mesh and the module parallelizes itself from it. :func:`parallelize_model` is the one function a module calls: it
reads the :class:`~lightning_dta.contracts.ParallelLayout` the strategy offers and applies FSDP2 over its
data-parallel mesh (each decoder layer, then the root), then allocates a model that was built on the meta device
and loads its checkpoint into the shards, so no rank ever holds the whole model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from lightning_dta.contracts import ParallelLayout
from lightning_dta.distributed.sharding import ShardingError, is_sharded, load_hf_checkpoint, materialize, shard


def parallelize_model(model: nn.Module, layout: ParallelLayout, device: torch.device,
                      checkpoint: str | Path | None = None) -> nn.Module:
    """Shard ``model`` as ``layout`` asks (nothing to do when it replicates the weights or ``model`` is sharded
    already); a model on the meta device is allocated on ``device`` and loaded from the Hugging Face
    ``checkpoint`` (a local directory) into its shards."""
    sharding = layout.sharding
    if sharding is None or is_sharded(model):
        return model
    if layout.device_mesh is None:
        raise ShardingError("the layout shards the weights but carries no device mesh. Fix: parallelize in "
                            "configure_model, once the strategy has set up its environment")
    on_meta = any(p.is_meta for p in model.parameters())
    buffers = {name: b for name, b in model.named_buffers() if not b.is_meta}
    if sharding.param_dtype is not None:
        model.to(dtype=sharding.param_dtype)
    shard(model, layout.device_mesh["data_parallel"], mp_policy=sharding.mp_policy,
          reshard_after_forward=sharding.reshard_after_forward, offload=sharding.offload,
          wrap_modules=sharding.wrap_modules)
    if on_meta:
        if checkpoint is None:
            raise ShardingError("the model was built on the meta device but there is no checkpoint to load into its "
                                "shards. Fix: give DTAModule a local checkpoint path or a hub name")
        materialize(model, device, buffers)
        load_hf_checkpoint(model, checkpoint)
    return model
