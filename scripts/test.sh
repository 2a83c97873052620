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
# Two workers, each taking whole test files (their module fixtures, e.g. a started server,
# are built once); servers bind port 0 and kernel builds land by atomic rename, so the two
# do not collide. Much of a test's time is waiting (servers, subprocesses, Python), which
# the second worker fills: the suite takes about 16 minutes on two cores.
python -m pytest -q -p no:cacheprovider --durations=15 -n 2 --dist loadfile "$@"
