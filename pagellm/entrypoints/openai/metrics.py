"""Entrypoints stage: HTTP: GET /metrics, the engine's state in Prometheus text format.

The metric set is the engine's own (pagellm/metrics: counters, gauges, latency
histograms, all with a `model_name` label); this module only exports it, with two
additions:

- The scheduler gauges (running, waiting, KV cache usage, free blocks, ...) are taken
  from the AsyncLLM's EngineSnapshot. The engine refreshes its own copies only when it
  steps, so an idle engine that has just aborted requests would still report them
  running; the snapshot is taken after every pass of the engine loop, idle ones included.
- Metrics only the server knows (is the engine loop alive, how many blocks exist) are
  listed in SERVER_METRICS: to export another one, add a MetricSpec there.

Nothing here calls into the engine, which only its own thread may do: prometheus_client
metric objects are thread-safe to read, and the snapshot is immutable.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagellm.engine.async_llm import AsyncLLM
from pagellm.engine.async_requests import EngineSnapshot
from pagellm.entrypoints.openai.batch_runner import BatchProgress


@dataclass(frozen=True)
class MetricSpec:
    name: str
    documentation: str
    kind: Literal["gauge", "counter"]
    value: Callable[[AsyncLLM], float]


SERVER_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "pagellm:engine_alive",
        "1 while the engine loop runs, 0 once it has stopped (crashed or shut down).",
        "gauge",
        lambda llm: 1.0 if llm.is_alive else 0.0,
    ),
    MetricSpec(
        "pagellm:num_usable_blocks",
        "Device KV cache blocks that can hold tokens.",
        "gauge",
        lambda llm: llm.snapshot.num_usable_blocks,
    ),
    MetricSpec(
        "pagellm:num_unfinished_requests",
        "Requests the engine holds in any state (one per completion when n > 1).",
        "gauge",
        lambda llm: llm.snapshot.num_unfinished_requests,
    ),
)

# Engine gauges whose value comes from the latest snapshot (see the module docstring).
FRESH_GAUGES: dict[str, Callable[[EngineSnapshot], float]] = {
    "pagellm:num_requests_running": lambda s: s.stats.num_running,
    "pagellm:num_requests_waiting": lambda s: s.stats.num_waiting,
    "pagellm:num_requests_swapped": lambda s: s.stats.num_swapped,
    "pagellm:kv_cache_usage_perc": lambda s: s.stats.kv_cache_usage,
    "pagellm:cpu_kv_cache_usage_perc": lambda s: s.stats.host_kv_cache_usage,
    "pagellm:num_free_blocks": lambda s: s.num_free_blocks,
}


class ServerCollector(Collector):
    def __init__(self, async_llm: AsyncLLM, model_name: str) -> None:
        self.async_llm = async_llm
        self.model_name = model_name
        self.engine_registry: CollectorRegistry = async_llm.engine.metrics.prom.registry

    def collect(self) -> Iterator[Metric]:
        snapshot = self.async_llm.snapshot
        for family in self.engine_registry.collect():
            fresh = FRESH_GAUGES.get(family.name)
            if fresh is not None:
                yield self._single(family.name, family.documentation, "gauge", fresh(snapshot))
            else:
                yield self._relabel(family)
        for spec in SERVER_METRICS:
            yield self._single(spec.name, spec.documentation, spec.kind, spec.value(self.async_llm))

    def _relabel(self, family: Metric) -> Metric:
        """The family with `model_name` set to the served name (the engine labels its
        metrics with the checkpoint's name, which --served-model-name may change)."""
        if all(s.labels.get("model_name") == self.model_name for s in family.samples):
            return family
        relabeled = Metric(family.name, family.documentation, family.type, family.unit)
        relabeled.samples = [
            s._replace(labels={**s.labels, "model_name": self.model_name}) for s in family.samples
        ]
        return relabeled

    def _single(self, name: str, documentation: str, kind: str, value: float) -> Metric:
        family_class = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
        family = family_class(name, documentation, labels=["model_name"])
        family.add_metric([self.model_name], float(value))
        return family


class BatchCollector(Collector):
    """The Batch API's progress: lines done by outcome, batches not yet ended."""

    def __init__(self, progress: Callable[[], BatchProgress], model_name: str) -> None:
        self.progress = progress  # BatchServing.progress: read on the event loop, like the routes
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        progress = self.progress()
        lines = CounterMetricFamily(
            "pagellm:batch_requests", "Batch lines run since start, by outcome (completed: status 200).",
            labels=["model_name", "outcome"],
        )  # fmt: skip
        lines.add_metric([self.model_name, "completed"], float(progress.lines_completed))
        lines.add_metric([self.model_name, "failed"], float(progress.lines_failed))
        yield lines
        active = GaugeMetricFamily("pagellm:batches_active", "Batches not yet ended (validating to cancelling).", labels=["model_name"])
        active.add_metric([self.model_name], float(progress.batches_active))
        yield active


class AdapterCollector(Collector):
    """LoRA adapters (with --enable-lora): requests per adapter, and the slots' loads and
    evictions (the engine's snapshot: the runner reports them step by step)."""

    def __init__(self, async_llm: AsyncLLM, model_name: str) -> None:
        self.async_llm = async_llm
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        snapshot = self.async_llm.snapshot
        stats = snapshot.stats
        for name, counts, what in (
            ("pagellm:lora_requests_running", stats.running_by_adapter, "Requests running under each LoRA adapter."),
            ("pagellm:lora_requests_waiting", stats.waiting_by_adapter,
             "Requests waiting (or swapped out) under each LoRA adapter."),
        ):  # fmt: skip
            family = GaugeMetricFamily(name, what, labels=["model_name", "lora_name"])
            for adapter, count in sorted(counts.items()):
                family.add_metric([self.model_name, adapter], float(count))
            yield family
        for name, value, what in (
            ("pagellm:lora_adapter_loads", snapshot.num_lora_loads, "LoRA adapters copied into a slot."),
            ("pagellm:lora_adapter_evictions", snapshot.num_lora_evictions,
             "LoRA adapters taken out of their slot for another."),
        ):  # fmt: skip
            family = CounterMetricFamily(name, what, labels=["model_name"])
            family.add_metric([self.model_name], float(value))
            yield family


def make_registry(
    async_llm: AsyncLLM,
    model_name: str,
    batch_progress: Callable[[], BatchProgress] | None = None,
    adapters: bool = False,
) -> CollectorRegistry:
    """A registry of its own per app, so that several servers in one process never clash;
    adapters: the LoRA metrics too (--enable-lora)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServerCollector(async_llm, model_name))
    if batch_progress is not None:
        registry.register(BatchCollector(batch_progress, model_name))
    if adapters:
        registry.register(AdapterCollector(async_llm, model_name))
    return registry


def render(registry: CollectorRegistry) -> tuple[bytes, str]:
    """(body, content type) of a scrape."""
    return generate_latest(registry), CONTENT_TYPE_LATEST
