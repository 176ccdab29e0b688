"""What attending to a shared prefix keeps in memory per sibling batch: the model's attention vs prefix attention.

The model's own attention (``prefix_attention=False``: a KV cache and an explicit causal mask) concatenates the
prefix to every row's keys/values, and transformers' SDPA path, which takes no grouped-query heads together
with a mask, repeats them to all query heads (``repeat_kv``); SDPA saves those for backward, so until the
batch is popped every layer holds ``2 x rows x heads x (prefix + new) x head_dim`` elements, plus the
``rows x new x (prefix + new)`` mask (transformers 5.24). With ``flash_attention_2`` the mask makes it unpad
the keys/values row by row: ``2 x rows x kv_heads x (prefix + new) x head_dim`` elements, saved by the kernel.
Prefix attention reads the prefix in place from the path buffers: no copy, no mask; it saves only the chunks'
own queries, keys, values, output and log-sum-exp, which the model's path saves too.

Part 1 measures both on the CPU for one sibling batch of a small Qwen3-shaped model (bytes saved for
backward by one forward over a prefix) and checks the formula; part 2 computes the formula at AReaL-DTA's
scale (a 16K-token prefix, 8 rows, Qwen3-8B's shape).

    python benchmarks/prefix_copy_memory.py
"""

from __future__ import annotations

import argparse

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from lightning_dta.engine.forward import forward_batch
from lightning_dta.engine.memory import SavedTensorMeter
from lightning_dta.engine.model_info import inspect_model
from lightning_dta.engine.sibling_batch import SiblingBatch

QWEN3_8B = dict(num_hidden_layers=36, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128)


def predicted_bytes(shape: dict, rows: int, prefix: int, new: int, element: int) -> dict[str, int]:
    """Bytes per sibling batch, all layers: the model path's prefix copies and mask, and what both keep."""
    layers, heads, kv_heads, dim = (shape[k] for k in ("num_hidden_layers", "num_attention_heads",
                                                       "num_key_value_heads", "head_dim"))
    tokens = rows * new
    return {
        "model path (sdpa): keys/values repeated to every head and row": 2 * layers * rows * heads * (prefix + new)
        * dim * element,
        "model path (sdpa): explicit mask": rows * new * (prefix + new),
        "model path (flash_attention_2): keys/values unpadded per row": 2 * layers * rows * kv_heads * (prefix + new)
        * dim * element,
        "prefix path: prefix copies": 0,
        "both: own queries, keys, values, output, log-sum-exp": layers * (2 * tokens * heads * dim * element
                                                                           + 2 * tokens * kv_heads * dim * element
                                                                           + 4 * heads * tokens),
        "both: path buffers of the prefix (keys, values, their gradients)": 4 * layers * prefix * kv_heads * dim
        * element,
    }


def measured_bytes(prefix_attention: bool, shape: dict, rows: int, prefix: int, new: int) -> int:
    """Bytes saved for backward by one forward of ``rows`` chunks of ``new`` tokens over a ``prefix``."""
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=256, intermediate_size=4 * shape["hidden_size"], max_position_embeddings=4096,
                         **shape)
    config._attn_implementation = "sdpa"
    model = Qwen3ForCausalLM(config).train()
    info = inspect_model(model, True, prefix_attention, None)
    past = [tuple(torch.randn(1, shape["num_key_value_heads"], prefix, shape["head_dim"]).requires_grad_()
                  for _ in range(2)) for _ in range(shape["num_hidden_layers"])]
    batch = SiblingBatch([torch.randint(256, (new,)) for _ in range(rows)], prefix, info.packs_siblings)
    columns = [torch.arange(0)] * rows  # no logits: the attention's share is what differs
    with SavedTensorMeter(model) as meter:
        logits, new_kv, _ = forward_batch(model, info, batch, past, columns)
        peak = meter.current_bytes
        del logits, new_kv
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--new", type=int, default=1024, help="new tokens per row at AReaL-DTA's scale")
    args = parser.parse_args()

    small = dict(num_hidden_layers=2, hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=32)
    rows, prefix, new = 8, 1024, 32
    model_path = measured_bytes(False, small, rows, prefix, new)
    prefix_path = measured_bytes(True, small, rows, prefix, new)
    formula = predicted_bytes(small, rows, prefix, new, 4)
    copies = sum(v for k, v in formula.items() if k.startswith("model path (sdpa)"))
    print(f"measured on the CPU, float32, {small['num_hidden_layers']} layers, {small['num_attention_heads']} heads / "
          f"{small['num_key_value_heads']} kv heads x {small['head_dim']}, {rows} rows x {new} tokens over a "
          f"{prefix}-token prefix, bytes saved for backward by one sibling-batch forward:")
    print(f"  model attention  {model_path / 2**20:8.2f} MiB")
    print(f"  prefix attention {prefix_path / 2**20:8.2f} MiB")
    print(f"  difference       {(model_path - prefix_path) / 2**20:8.2f} MiB; formula for the model path's copies "
          f"and mask: {copies / 2**20:.2f} MiB")
    print(f"\ncomputed at AReaL-DTA's scale: Qwen3-8B shape ({QWEN3_8B}), bf16, a 16384-token prefix, "
          f"{args.rows} rows x {args.new} new tokens, per sibling batch:")
    for what, value in predicted_bytes(QWEN3_8B, args.rows, 16384, args.new, 2).items():
        print(f"  {what:<70} {value / 2**30:8.2f} GiB")


if __name__ == "__main__":
    main()
