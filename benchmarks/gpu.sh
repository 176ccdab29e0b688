#!/usr/bin/env bash
# The GPU check, one prepared run within 8 minutes on one H100/H200-class GPU:
#   1. the GPU tests (prefix-attention kernels and their self-check, exactness in float32 and bfloat16 for every
#      backend and for the model's attention with sdpa and flash_attention_2, memory flat in leaves, no host
#      sync in the walk), then
#   2. the benchmark suite on Qwen3-0.6B- and Qwen3-1.7B-shaped models (random weights, bf16): GRPO, a
#      multi-turn agent with a 16K-token history and tree search, every mode side by side (CUDA peak memory,
#      speed-up vs vanilla and vs checkpointed vanilla, the FLOP-limit column), PrefixGrouper where it is
#      installed (with flash-attn), then
#   3. the targets, read from the bench.json files.
# Output: stdout, and ${OUT:-bench_out}/gpu/{gpu_tests.txt,<preset>/bench.json,...}.
#   bash benchmarks/gpu.sh                 # on the GPU machine
#   SMOKE=1 bash benchmarks/gpu.sh         # the same plumbing at toy sizes on the CPU (no GPU needed)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-bench_out}/gpu"
PY="${PYTHON:-python}"
mkdir -p "$OUT_DIR"
COMMON=(--dtype bfloat16 --device cuda --attn sdpa --repeats 2 --warmup 1 --no-progress --no-plots
        --modes vanilla,vanilla-ckpt,vanilla-batched,dfs,dfs-recompute,dfs-model-attention,prefix-grouper
        --recompute-chunk 2048 --engine.sibling_batch_tokens 32768 --engine.vanilla_batch_tokens 32768)
GRPO=(--grpo-prompts 4 --grpo-group 16 --grpo-prompt-len 1500,2500 --grpo-response-len 256,1536)
AGENT=(--agent-episodes 2 --agent-turns 8 --agent-system-len 14500 --agent-thinking-len 200,800)
TREE=(--tree-prompt-len 1024 --tree-branching 4,3,2)
SMALL_PRESET=(--preset qwen3-0.6b)
LARGE_PRESET=(--preset qwen3-1.7b)
EXTRA=(--memory-leaves 8,16,32 --long-len 16384)
TESTS="-m gpu tests/gpu tests/lightning/test_accelerate.py"
LIMITS=(120 210 150)  # seconds: tests, Qwen3-0.6B, Qwen3-1.7B
if [ "${SMOKE:-0}" = "1" ]; then  # toy sizes on the CPU: checks the script, the flags and the report
  COMMON=(--dtype float32 --device cpu --repeats 1 --warmup 1 --no-progress --no-plots
          --modes vanilla,vanilla-ckpt,vanilla-batched,dfs,dfs-recompute,dfs-model-attention,prefix-grouper
          --recompute-chunk 32 --engine.sibling_batch_tokens 512 --engine.vanilla_batch_tokens 512)
  GRPO=(--grpo-prompts 1 --grpo-group 3 --grpo-prompt-len 40,60 --grpo-response-len 8,16)
  AGENT=(--agent-episodes 1 --agent-turns 3 --agent-system-len 96 --agent-thinking-len 8,16)
  TREE=(--tree-prompt-len 32 --tree-branching 2,2)
  SMALL_PRESET=(--arch qwen3 --layers 1 --hidden 64 --heads 4 --kv-heads 2 --vocab 256)
  LARGE_PRESET=(--arch qwen3 --layers 2 --hidden 64 --heads 4 --kv-heads 2 --vocab 256)
  EXTRA=(--memory-leaves 2,4 --long-len 128)
  TESTS="tests/gpu -rs"
  LIMITS=(120 120 120)
fi

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
  torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')"
"$PY" -c "import flash_attn; print('flash-attn', flash_attn.__version__)" 2>/dev/null || echo "flash-attn: not installed"
"$PY" -c "import prefix_grouper; print('prefix_grouper', prefix_grouper.__version__)" 2>/dev/null \
  || echo "prefix_grouper: not installed (the prefix-grouper mode is skipped)"

echo "== 1. GPU tests"
# shellcheck disable=SC2086
timeout "${LIMITS[0]}" "$PY" -m pytest -q -s $TESTS 2>&1 | tee "$OUT_DIR/gpu_tests.txt"
echo "GPU tests exit status: ${PIPESTATUS[0]}"

echo "== 2a. Qwen3-0.6B shape: GRPO, agent (16K-token history), tree search"
timeout "${LIMITS[1]}" "$PY" -m lightning_dta.bench.cli "${SMALL_PRESET[@]}" "${COMMON[@]}" "${GRPO[@]}" \
  "${AGENT[@]}" "${TREE[@]}" "${EXTRA[@]}" --out "$OUT_DIR/qwen3-0.6b"
echo "exit status: $?"

echo "== 2b. Qwen3-1.7B shape: GRPO, agent (16K-token history)"
timeout "${LIMITS[2]}" "$PY" -m lightning_dta.bench.cli "${LARGE_PRESET[@]}" "${COMMON[@]}" "${GRPO[@]}" \
  "${AGENT[@]}" --workloads grpo,agent --no-logprobs --memory-leaves "" --long-len 0 --out "$OUT_DIR/qwen3-1.7b"
echo "exit status: $?"

echo "== 3. targets"
"$PY" benchmarks/gpu_targets.py "$OUT_DIR"
