#!/usr/bin/env bash
# Install pagellm with its test dependencies and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
PAGELLM_EXTRAS=test bash scripts/install.sh
. .venv/bin/activate
python -m pytest -q -p no:cacheprovider "$@"
