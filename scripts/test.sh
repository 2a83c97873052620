#!/usr/bin/env bash
# Install pagellm with its test dependencies and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
PAGELLM_EXTRAS=test bash scripts/install.sh
# Headless Chromium for the dashboard test (Debian's package). Best effort: where it
# cannot be installed that one test is skipped with its reason.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) \
        >/dev/null 2>&1 || echo "note: could not install chromium; the dashboard browser test will skip"
fi
. .venv/bin/activate
python -m pytest -q -p no:cacheprovider --durations=15 "$@"
