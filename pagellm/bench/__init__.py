"""Bench stage: `pagellm bench throughput|serve|knobs|kernels`, the peer backends they compare
with, and the code behind the benchmarks/ scripts that tests import too (the GPU check, the
tensor-parallel overhead, the soak harness, shared random inputs)."""
