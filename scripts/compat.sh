#!/usr/bin/env bash
# The compatibility matrix: the engine's exactness tests and one `fit` under each listed transformers release,
# each in a fresh virtual environment of its own under .compat/ (git-ignored). Not part of `bash .ci/run` (one
# version takes 6-10 minutes on 2 cores, installs included); run it before changing pyproject.toml's bounds.
#
#   bash scripts/compat.sh                       # the default matrix: the device image's release, the oldest
#                                                # claimed and the newest the registry serves
#   bash scripts/compat.sh 5.17.0 5.24.0         # chosen releases
#   TESTS="tests/engine/test_exactness.py" bash scripts/compat.sh 5.2.0
#
# Each version prints one line "transformers V (torch T): N passed, ..." and leaves its log in
# .compat/logs/transformers-V.log. torch is pinned to ${TORCH:-2.13.0} (the local CPU wheel; an unpinned torch
# pulls a multi-GB CUDA build).
set -uo pipefail
cd "$(dirname "$0")/.."
VERSIONS=("$@")
if [ ${#VERSIONS[@]} -eq 0 ]; then
  VERSIONS=(5.0.0 5.17.0 5.24.0)
fi
TORCH="${TORCH:-2.13.0}"
TESTS="${TESTS:-tests/engine/test_exactness.py tests/engine/test_model_checks.py tests/engine/test_prefix_attention.py
tests/engine/test_attention_check.py tests/lightning/test_cli.py::test_fit_tiny_cpu}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
mkdir -p .compat/logs
status=0
for version in "${VERSIONS[@]}"; do
  env_dir=".compat/transformers-$version"
  log=".compat/logs/transformers-$version.log"
  if [ ! -x "$env_dir/bin/python" ]; then
    python3 -m venv "$env_dir"
    "$env_dir/bin/python" -m pip install --quiet --upgrade pip
    "$env_dir/bin/python" -m pip install --quiet "torch==$TORCH"
  fi
  if ! "$env_dir/bin/python" -m pip install --quiet -e ".[test]" "transformers==$version" "torch==$TORCH" \
      >"$log" 2>&1; then
    echo "transformers $version: install failed (see $log)"
    status=1
    continue
  fi
  # shellcheck disable=SC2086
  "$env_dir/bin/python" -m pytest -q -p no:cacheprovider -n "${PYTEST_WORKERS:-2}" --dist loadfile $TESTS \
    >>"$log" 2>&1
  rc=$?
  [ $rc -eq 0 ] || status=1
  installed=$("$env_dir/bin/python" -c "import torch, transformers; print(transformers.__version__, torch.__version__)")
  echo "transformers ${installed% *} (torch ${installed#* }): $(tail -n 1 "$log" | tr -d '=') [exit $rc]"
done
exit $status
