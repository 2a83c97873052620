#!/usr/bin/env bash
# Install pagellm and run the main job on the embedded SmolLM2-135M-Instruct model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
if [ "$#" -eq 0 ]; then
    set -- generate --chat --max-tokens 64 "What is the capital of France?"
fi
pagellm "$@"
