"""A checkpoint with tied embeddings, loaded into shards under ``dta_fsdp``, is the checkpoint's model.

``accelerate.init_empty_weights`` re-registers the head that ``tie_weights`` assigns as a parameter of its own, so a
model built on the meta device had an untied head, which the checkpoint load skipped as a tied key: an uninitialised
head, and a step-1 loss of 0.17144 under ``dta_fsdp`` for 0.17036 under ``dta`` (a tiny tied Llama), without a word.
The generator's unsharded copy of such a model refused to copy (its head had no source). One process, a 1-rank gloo
group: the load and the copy are the same code on any number of ranks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_dta.distributed.sharding import load_hf_checkpoint, materialize, shard, unsharded_copy
from lightning_dta.models import build_on_meta
from tests.helpers.tp import free_port

pytestmark = pytest.mark.distributed


def test_a_tied_checkpoint_loads_into_shards_and_copies_back(tmp_path: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    reference = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    reference.save_pretrained(tmp_path)
    model, path = build_on_meta(tmp_path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    buffers = {name: b for name, b in model.named_buffers() if not b.is_meta}
    shard(model, init_device_mesh("cpu", (1,)))  # parallelize_model's order: shard, allocate, load
    materialize(model, torch.device("cpu"), buffers)
    load_hf_checkpoint(model, path)
    head, embedding = model.lm_head.weight.full_tensor(), model.model.embed_tokens.weight.full_tensor()
    assert torch.equal(head, reference.lm_head.weight) and torch.equal(embedding, reference.lm_head.weight)
    copy = unsharded_copy(model)
    assert copy.lm_head.weight is copy.model.embed_tokens.weight
    ids = torch.randint(0, 64, (1, 12))
    torch.testing.assert_close(copy(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=0, atol=0)
