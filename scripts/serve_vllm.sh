#!/usr/bin/env bash
# A real vLLM server (PyPI's CPU build in .venv-vllm: bash scripts/install_vllm.sh) for the toy task and the tests,
# with the flags measured in DESIGN.md section 10. Serves MODEL_DIR as "toy" on 127.0.0.1:PORT (default 8000);
# further arguments go to vLLM (a later flag overrides an earlier one, e.g. --served-model-name NAME).
#
#   bash scripts/serve_vllm.sh runs/toy_rl_vllm/server_model 8000 > server.log 2>&1 &
#
# Why each setting: VLLM_SERVER_DEV_MODE=1 offers /collective_rpc and /reset_prefix_cache (weight_sync: vllm needs
# them); VLLM_ENABLE_V1_MULTIPROCESSING=0 and --distributed-executor-backend uni keep the engine in this process
# (~20 s to start, ~1.5 GB); --kv-cache-memory-bytes 64 MiB instead of the CPU default of several GB
# (VLLM_CPU_KVCACHE_SPACE would override it, and crashes start-up when empty: unset); OMP_NUM_THREADS=1 and
# VLLM_CPU_OMP_THREADS_BIND=nobind share the cores instead of pinning them; float32 and eager mode keep its log-probs
# the trainer's to rounding. The `vllm` command is broken in this distribution: python -m ... api_server.
set -euo pipefail
MODEL="${1:?usage: serve_vllm.sh MODEL_DIR [PORT] [vLLM flags...]}"
PORT="${2:-8000}"
shift $(( $# < 2 ? $# : 2 ))
VENV="$(cd "$(dirname "$0")/.." && pwd)/.venv-vllm"
unset VLLM_CPU_KVCACHE_SPACE
export VLLM_SERVER_DEV_MODE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=nobind
exec "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name toy \
    --host 127.0.0.1 --port "$PORT" --dtype float32 --enforce-eager --distributed-executor-backend uni \
    --kv-cache-memory-bytes 67108864 --max-model-len 256 "$@"
