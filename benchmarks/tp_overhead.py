"""Tensor parallelism on the CPU: what TP=2 adds to a decode step against TP=1, and where it goes.

    python benchmarks/tp_overhead.py                     # synthetic Llama (30 layers), float32
    python benchmarks/tp_overhead.py --quick             # a smoke run: fewer steps (under a minute)
    python benchmarks/tp_overhead.py --dtype bfloat16
    python benchmarks/tp_overhead.py --model PATH        # an HF folder or GGUF file that TP=2 splits

How it measures, what it writes and how to read it: pagellm/bench/tp_overhead.py (the
benchmark is package code, which tests import; this script is its command line).
"""

from pathlib import Path

from pagellm.bench.tp_overhead import main

if __name__ == "__main__":
    # The results go beside this script, wherever it is run from.
    main(results_dir=Path(__file__).resolve().parent / "results")
