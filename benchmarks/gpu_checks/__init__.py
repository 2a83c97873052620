"""The sections of benchmarks/gpu_check.py (see its docstring)."""
