"""Bench stage: the GPU check that benchmarks/gpu_check.py runs (its docstring lists the
sections): the sections, their driver (runner.py) and HF transformers as the baseline."""
