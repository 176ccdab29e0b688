#!/usr/bin/env bash
# The benchmark suite on one H100/H200-class GPU with a Qwen3-0.6B-shaped model (random weights, bf16),
# GRPO / multi-turn agent / tree-search steps at realistic sizes. About 5-8 minutes; writes the table to
# stdout and bench.json + PNG plots to ${OUT:-bench_out/gpu}.
#   bash benchmarks/gpu.sh                 # sdpa attention
#   ATTN=flash_attention_2 bash benchmarks/gpu.sh   # needs flash-attn (pip install -e ".[gpu]"); skips "mask"
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-bench_out}/gpu"
ATTN="${ATTN:-sdpa}"
MODES="vanilla,vanilla-ckpt,vanilla-batched,mask,dfs,dfs-recompute"
if [ "$ATTN" = "flash_attention_2" ]; then MODES="vanilla,vanilla-ckpt,vanilla-batched,dfs,dfs-recompute"; fi
nvidia-smi --query-gpu=name,memory.total --format=csv || true
python -m lightning_dta.bench.cli \
  --device cuda --dtype bfloat16 --preset qwen3-0.6b --attn "$ATTN" \
  --modes "$MODES" --repeats 3 --warmup 1 \
  --grpo-prompts 4 --grpo-group 16 --grpo-prompt-len 1500,2500 --grpo-response-len 256,1536 \
  --agent-episodes 4 --agent-turns 8 --agent-system-len 4800 --agent-thinking-len 200,800 \
  --tree-prompt-len 1024 --tree-branching 4,3,2 \
  --chunk-size 2048 --sibling-batch-tokens 32768 --vanilla-batch-tokens 32768 \
  --memory-leaves 8,16,32,64 --long-len 16384 \
  --no-progress --out "$OUT_DIR"
