"""Workload stage: the synthetic request lists, arrival times and latency statistics that
both bench/ and sim/ use, and how their commands hand back results (command_output.py);
below both, so neither imports the other for them."""
