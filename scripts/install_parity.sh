#!/usr/bin/env bash
# The parity environment: lightning_dta with TRL 1.16.0, verl 0.9.1 and AReaL 1.0.4 installed, so that
# tests/parity/ compare our losses with theirs (without it those tests skip, saying why).
#
#   bash scripts/install_parity.sh [VENV]        # default VENV: .venv-parity (git-ignored)
#   . .venv-parity/bin/activate && OMP_NUM_THREADS=1 python -m pytest -q -p no:cacheprovider \
#       tests/parity tests/integrations/test_trl_trainer.py tests/test_readme.py
#   (add -m long for the learning run). Run the rest of the suite in the default .venv: AReaL's omegaconf/hydra
#   pins change how jsonargparse reads LightningCLI configs, so the CLI tests fail in this environment.
#
# TRL comes from the `trl` extra. verl and AReaL cannot: their metadata pins older torch/transformers and ~80
# packages their loss code never imports, so they go in with --no-deps, followed by exactly what
# `import verl.trainer.ppo.core_algos` / `areal.utils.functional` need (found one ImportError at a time).
# torch stays pinned throughout (a constraint on every install).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-parity}"
python3 -m venv "$VENV"
. "$VENV/bin/activate"
python -m pip install --quiet --upgrade pip
PIN="$(mktemp)"
echo "torch==2.13.0" > "$PIN"
python -m pip install --quiet torch==2.13.0
python -m pip install --quiet -c "$PIN" -e ".[test,trl]"
python -m pip install --quiet --no-deps verl==0.9.1
python -m pip install --quiet -c "$PIN" ray "tensordict!=0.9.0,<=0.10.0,>=0.8.0" codetiming
python -m pip install --quiet --no-deps areal==1.0.4
python -m pip install --quiet -c "$PIN" aiohttp httpx colorlog tenacity flask torchdata lark uvloop numba pillow \
    einops aiofiles openai "hydra-core==1.4.0.dev1" "omegaconf==2.4.0.dev2"
python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
rm -f "$PIN"
echo "parity environment ready: $VENV"
