#!/usr/bin/env bash
# GPU check: run benchmarks/gpu_check.py from the repository root,
# stopped after 9.5 minutes whatever happens (the script's own deadline is shorter, and on
# SIGTERM it still prints its table). PYTHON=.venv/bin/python picks another interpreter.
set -u
cd "$(dirname "$0")/.." || exit 1
# This checkout's pagellm, installed or not (a GPU machine may get the tree without an install).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 570 "${PYTHON:-python}" benchmarks/gpu_check.py "$@"
