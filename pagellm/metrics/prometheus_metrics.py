"""Metrics stage: the Prometheus metric objects of one engine.

Names follow vLLM's where the metric is the same, under a `pagellm:` prefix, and every
metric carries a `model_name` label. Each engine has its own registry, so several
engines (tests, benchmarks) never collide.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from pagellm.metrics.memory_metrics import MemoryCollector

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
_LENGTH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)
_STEP_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_COMPILE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_MASK_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class PrometheusMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        reg = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"pagellm:{name}", doc, labels, registry=reg).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"pagellm:{name}", doc, labels, registry=reg).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(
                f"pagellm:{name}", doc, labels, buckets=buckets, registry=reg
            ).labels(model_name)

        self.memory = MemoryCollector(model_name)  # pagellm:memory_bytes, by component
        reg.register(self.memory)
        self.sleep_level = gauge("sleep_level", "0: awake; 1: asleep, KV cache freed; 2: the weights freed too.")
        self.num_requests_running = gauge("num_requests_running", "Requests in the running set.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting for admission.")
        self.num_requests_swapped = gauge("num_requests_swapped", "Requests swapped out to host memory.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).")
        self.cpu_kv_cache_usage_perc = gauge("cpu_kv_cache_usage_perc", "Fraction of host (swap) blocks in use (0-1).")
        self.num_free_blocks = gauge("num_free_blocks", "Free KV cache blocks (cached-free included).")
        self.model_flops_utilization = gauge(
            "model_flops_utilization", "Estimated FLOP/s over the device's matmul ceiling, last window (0-1)."
        )
        self.memory_bandwidth_utilization = gauge(
            "memory_bandwidth_utilization", "Estimated bytes/s (weights, KV) over the device's bandwidth, last window (0-1)."
        )
        self.cpu_kernels = Info(
            "pagellm:cpu_kernels", "The CPU kernels in use: ISA levels and each linear group's measured choice.",
            labels, registry=reg,
        ).labels(model_name)  # fmt: skip
        self.kv_cache_bytes_per_token = gauge(
            "kv_cache_bytes_per_token", "KV cache bytes one token of context takes over the global attention layers."
        )
        self.state_bytes_per_request = gauge(
            "state_bytes_per_request", "A hybrid model's recurrent state per request over its linear-attention layers (0: none)."
        )
        self.num_state_slots = gauge("num_state_slots", "A hybrid model's recurrent-state slots (one per running request).")
        self.num_state_snapshots = gauge(
            "num_state_snapshots", "A hybrid model's recurrent-state snapshots kept for prefix hits (capacity)."
        )
        self.flops_ceiling = gauge("flops_ceiling", "The device's matmul ceiling used for MFU (FLOP/s).")
        self.bandwidth_ceiling = gauge("bandwidth_ceiling", "The device's memory bandwidth used for MBU (bytes/s).")
        self.estimated_flops = counter("estimated_flops", "FLOPs of the steps run (matmuls, attention, LM head).")
        self.estimated_bytes = counter("estimated_bytes", "Bytes the steps moved: weights once per step, KV read and written.")

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests whose prefill finished.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.embedding_requests = counter("embedding_requests", "Prompt-only requests (embeddings, scores) finished with their pooled output.")
        self.prefill_tokens = counter("prefill_tokens", "Prompt-position tokens computed (recomputation included).")
        self.decode_tokens = counter("decode_tokens", "Output-position tokens computed.")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Tokens found in the prefix cache.")
        preemptions = Counter("pagellm:num_preemptions", "Preemptions, by mode.", ["model_name", "mode"], registry=reg)
        self.preemptions = {mode: preemptions.labels(model_name, mode) for mode in ("recompute", "swap")}
        self.swapped_in_blocks = counter("swapped_in_blocks", "Blocks copied host -> device.")
        self.swapped_out_blocks = counter("swapped_out_blocks", "Blocks copied device -> host.")
        self.block_allocation_attempts = counter("block_allocation_attempts", "Calls to allocate_slots.")
        self.block_allocation_failures = counter(
            "block_allocation_failures", "allocate_slots calls that found no room."
        )
        self.kv_tier_hit_blocks = counter("kv_tier_hit_blocks", "Blocks found in the prefix cache's tier after a device miss, loaded.")
        self.kv_tier_miss_blocks = counter("kv_tier_miss_blocks", "Blocks looked up after a device miss that the tier lacked.")
        self.kv_tier_skipped_blocks = counter(
            "kv_tier_skipped_blocks", "Blocks the tier held but computed instead (reading was measured slower)."
        )
        self.kv_tier_failed_loads = counter("kv_tier_failed_loads", "Tier entries found missing, truncated or corrupt when read.")
        self.kv_tier_written_blocks = counter("kv_tier_written_blocks", "Blocks written to the tier.")
        self.kv_tier_written_states = counter(
            "kv_tier_written_states", "A hybrid model's recurrent-state snapshots written to the tier."
        )
        self.kv_tier_loaded_states = counter(
            "kv_tier_loaded_states", "A hybrid model's recurrent-state snapshots loaded from the tier and verified."
        )
        self.kv_tier_dropped_writes = counter("kv_tier_dropped_writes", "Blocks not written: the tier's write queue was full.")
        self.kv_tier_read_bytes = counter("kv_tier_read_bytes", "Bytes read from the tier.")
        self.kv_tier_written_bytes = counter("kv_tier_written_bytes", "Bytes written to the tier.")
        self.kv_tier_bytes = gauge("kv_tier_bytes", "Bytes the prefix cache's tier holds.")
        self.kv_tier_load_seconds = histogram(
            "kv_tier_load_seconds", "Wall time of one step's loads from the tier.", _LATENCY_BUCKETS
        )
        self._success = Counter(
            "pagellm:request_success", "Finished requests, by finish reason.",
            ["model_name", "finished_reason"], registry=reg,
        )  # fmt: skip
        self._rejected = Counter(
            "pagellm:request_rejected", "Refused requests, by reason.",
            ["model_name", "reason"], registry=reg,
        )  # fmt: skip
        self._model_name = model_name

        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Arrival to first token.", _LATENCY_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between two tokens of a completion.", _LATENCY_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduling.", _LATENCY_BUCKETS
        )
        self.request_prefill_time = histogram(
            "request_prefill_time_seconds", "First scheduling to first token.", _LATENCY_BUCKETS
        )
        self.request_decode_time = histogram(
            "request_decode_time_seconds", "First token to finish.", _LATENCY_BUCKETS
        )
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt length per request.", _LENGTH_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per request (all completions).", _LENGTH_BUCKETS
        )
        self.iteration_tokens = histogram("iteration_tokens", "Tokens computed per step.", _STEP_BUCKETS)
        self.iteration_requests = histogram("iteration_requests", "Requests scheduled per step.", _STEP_BUCKETS)
        self.grammar_compile_seconds = histogram(
            "grammar_compile_seconds", "Compile time of each new output constraint (JSON schema, regex, grammar).",
            _COMPILE_BUCKETS,
        )  # fmt: skip
        self.grammar_cache_hits = counter("grammar_cache_hits", "Output constraints found already compiled.")
        self.failed_steps = counter("failed_steps", "Engine steps that raised (their requests were ended).")
        self.request_failures = counter(
            "request_failures", "Requests ended because an engine step they were in failed."
        )
        self.spec_decode_num_drafts = counter("spec_decode_num_drafts", "Speculative verifications (one per request and step).")
        self.spec_decode_num_draft_tokens = counter("spec_decode_num_draft_tokens", "Tokens proposed for verification.")
        self.spec_decode_num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Proposed tokens the model accepted.")
        self.spec_decode_num_emitted_tokens = counter(
            "spec_decode_num_emitted_tokens", "Tokens verifications emitted (accepted ones plus the model's own next)."
        )
        self.structured_mask_seconds = histogram(
            "structured_mask_seconds", "Per step with constrained requests: time to fill and apply their token masks.",
            _MASK_BUCKETS,
        )  # fmt: skip

    def request_success(self, finished_reason: str) -> Counter:
        return self._success.labels(self._model_name, finished_reason)

    def request_rejected(self, reason: str) -> Counter:
        return self._rejected.labels(self._model_name, reason)
