"""Soak test: hours (or minutes) of mixed, hostile traffic against a real `pagellm serve`.

    python benchmarks/soak.py [--duration 600] [--model PATH] [--seed 0] [--out-dir DIR]

What it sends, what it checks and what it writes: pagellm/bench/soak.py (the harness is
package code; this script is its command line). Exit status 0 when every check passed.
"""

import sys
from pathlib import Path

from pagellm.bench.soak import main

if __name__ == "__main__":
    # The results go beside this script, wherever it is run from.
    sys.exit(main(results_dir=Path(__file__).resolve().parent / "results"))
