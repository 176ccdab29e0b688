#!/usr/bin/env bash
# The GPU check: one prepared run of at most 8 minutes on one H100/H200-class GPU, made for a one-shot window on a
# machine with no network (benchmarks/gpu_run.py has the phases and budgets):
#   1. readiness: versions, the flash kernels' schemas, the device and its capability, every self-check figure of
#      prefix attention's kernels and of the recurrent mixers' kernels (fla / causal-conv1d / mamba_ssm against the
#      pure-PyTorch path, initial-state gradients included), the matrix-product rate (90 s at most);
#   2. the GPU tests (pytest -m gpu: the kernels, exactness in float32 and bfloat16, memory flat in leaves, no host
#      sync from the first step on; 120 s at most). Online RL: tests/gpu/test_vllm_nccl.py (weight_sync: vllm-nccl
#      against a real vLLM GPU server) skips here, with its reason: it needs two GPUs (NCCL refuses two ranks on
#      one) and LIGHTNING_DTA_VLLM_GPU_PYTHON (a vLLM 0.32 CUDA environment), which this image has not;
#   3. the bench on Qwen3-0.6B- and Qwen3-1.7B-shaped models (random weights, bf16): GRPO, a multi-turn agent,
#      tree search, every mode side by side; each workload's rows land in <run>.jsonl as soon as it is measured,
#      each run's budget comes from its FLOP estimate (printed beside it);
#   4. the targets, from what was written.
# Output: stdout, and ${OUT:-bench_out}/gpu/ (readiness.json, gpu_tests.txt, <run>.jsonl, phases.jsonl, ...);
# with ARCHIVE=FILE also a .tar.gz of that folder after the run (the device tool brings back at most 8 files).
#
#   bash benchmarks/gpu.sh                  # on the GPU machine (python3 from its image)
#   DRY_RUN=1 bash benchmarks/gpu.sh        # the plan: every bench run's FLOP estimate and budget; runs nothing
#   SMOKE=1 bash benchmarks/gpu.sh          # the same phases at toy sizes on the CPU (CI runs this)
#
# The device image has torch 2.11 (a CUDA build), transformers, lightning, accelerate, pytest, pytest-xdist,
# pytest-timeout and PyYAML, but not jsonargparse (which the bench CLI parses with) nor docstring-parser (its field
# help), and no network. The package is not pip-installed: the tree goes on PYTHONPATH, so nothing can replace the
# image's torch or reach for the network, and benchmarks/gpu_requirements.py then checks what pip would have (the
# requirements of pyproject.toml) and every torch API the package calls; anything missing refuses the run at the start
# (exit status 2) with its name. Carry the two wheels in .whl/ (git-ignored; 0.2 MiB together, pure Python;
# jsonargparse needs only PyYAML, which the image has):
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl jsonargparse==4.53.0 docstring-parser==0.18.0
# and name .whl in the device call's carry; this script installs them from there, without the network and without
# their dependencies (DRY_RUN=1 prints the install step):
#   ARCHIVE=$OUT/gpu.tgz bash benchmarks/gpu.sh 2>&1 | tee $OUT/gpu.log
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
OUT_DIR="${OUT:-bench_out}/gpu"
WHEELS="${WHEELS:-.whl}"
SITE=/tmp/lightning_dta_site
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the package from this tree, not installed
mkdir -p "$OUT_DIR"
install=("$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE")
echo "install: the package from $PWD on PYTHONPATH (no pip install of it, nor of torch); jsonargparse and" \
  "docstring-parser where absent: ${install[*]} $WHEELS/*.whl"
if ! "$PY" -c "import jsonargparse, docstring_parser" 2>/dev/null; then
  if [ "${DRY_RUN:-}" = 1 ]; then
    echo "DRY_RUN: jsonargparse or docstring-parser is absent; the run would install $WHEELS/*.whl as above"
  elif compgen -G "$WHEELS/*.whl" >/dev/null; then
    "${install[@]}" "$WHEELS"/*.whl && export PYTHONPATH="$PYTHONPATH:$SITE"
  else
    echo "jsonargparse is not installed and $WHEELS/ holds no wheels: the bench runs will be skipped (see above)"
  fi
fi
if ! "$PY" benchmarks/gpu_requirements.py; then
  echo "benchmarks/gpu.sh: refused at the start: this Python cannot run the package (above)" >&2
  exit 2
fi
"$PY" benchmarks/gpu_run.py --out "$OUT_DIR" --python "$PY"
status=$?
if [ -n "${ARCHIVE:-}" ]; then
  tar -czf "$ARCHIVE" -C "$(dirname "$OUT_DIR")" "$(basename "$OUT_DIR")" && echo "archived $OUT_DIR in $ARCHIVE"
fi
exit $status
