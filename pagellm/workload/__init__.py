"""Workloads: the synthetic request lists, arrival times and latency statistics that
both bench/ and sim/ use (below both, so neither imports the other for them)."""
