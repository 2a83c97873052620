"""Benchmarks: `pagellm bench throughput|serve` and the peer backends they compare with."""
