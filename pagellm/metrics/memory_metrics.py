"""Metrics stage: `pagellm:memory_bytes{component}`, where the engine's memory goes.

The components rank 0 reported at start (worker/memory_report.py): weights, kv_cache,
kv_swap_space, recurrent_state, tier_host_cache. Read at each scrape: process_resident
(the resident set) and, on a CPU, kv_cache_resident (the KV cache's pages touched so far:
it is shared memory, reserved at start and resident as blocks are first written) and
activations_and_other (the resident set beyond the weights, the touched KV cache, the
states and the tier's host cache: step buffers, kernels' scratch, the interpreter and its
libraries); on a GPU, device_reserved (torch's reserved memory) and activations_and_other
within it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from pagellm.metrics.resident_memory import read_resident_memory

def memory_components(static: Mapping[str, int], device_type: str) -> dict[str, int]:
    """The static components and, read now, the process's and the device's."""
    values = dict(static)
    held = static.get("weights", 0) + static.get("recurrent_state", 0) + static.get("tier_host_cache", 0)
    if device_type == "cuda":
        import torch

        reserved = torch.cuda.memory_reserved()
        values["device_reserved"] = reserved
        values["activations_and_other"] = max(0, reserved - held - static.get("kv_cache", 0))
    reading = read_resident_memory()
    if reading is not None:
        values["process_resident"] = reading.total
        if device_type == "cpu":
            values["kv_cache_resident"] = reading.shared
            values["activations_and_other"] = max(0, reading.total - reading.shared - held)
    return values


class MemoryCollector(Collector):
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.static: dict[str, int] = {}
        self.device_type = "cpu"

    def set_components(self, static: Mapping[str, int], device_type: str) -> None:
        self.static = dict(static)
        self.device_type = device_type

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "pagellm:memory_bytes", "Memory by component, in bytes (rank 0; see docs/observability.md).",
            labels=["model_name", "component"],
        )  # fmt: skip
        for component, value in (memory_components(self.static, self.device_type) if self.static else {}).items():
            family.add_metric([self.model_name, component], float(value))
        yield family
