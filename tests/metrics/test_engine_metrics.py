"""Metrics, the stats line, the time series and the KV event log on scripted runs."""

import json
import logging

import pytest
from hf_models import make_tiny_hf_checkpoint
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pagellm import LLM, SamplingParams
from pagellm.core.kv_replay import block_map_of, read_events, replay
from pagellm.config.cache import DTYPE_BYTES
from pagellm.errors import InvalidRequestError

PROMPTS = [[5 + i] * n for i, n in enumerate([3, 17, 32, 9, 40])]
MAX_TOKENS = [4, 10, 1, 7, 12]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(make_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny"), "llama", seed=2))


def sample(llm, name, **labels):
    labels.setdefault("model_name", llm.engine.config.source.name)
    return llm.engine.metrics.prom.registry.get_sample_value(name, labels)


def run(llm, prompts=PROMPTS, max_tokens=MAX_TOKENS, **kwargs):
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, **kwargs) for m in max_tokens]
    return llm.generate(prompts, params, use_tqdm=False)


def test_counters_equal_the_work_done_and_gauges_return_to_zero(folder):
    llm = LLM(folder, max_model_len=128, enable_prefix_caching=False, max_num_batched_tokens=16)
    run(llm)
    m = llm.get_metrics()
    assert m.prompt_tokens == sum(map(len, PROMPTS))
    assert m.generation_tokens == sum(MAX_TOKENS)
    assert m.scheduler.num_prefill_tokens == sum(map(len, PROMPTS))
    # The last token of each request is sampled but never fed back.
    assert m.scheduler.num_decode_tokens == sum(t - 1 for t in MAX_TOKENS)
    assert m.finished_requests == {"length": len(PROMPTS)}
    assert m.latencies["ttft"].count == len(PROMPTS)
    assert m.latencies["itl"].count == sum(t - 1 for t in MAX_TOKENS)
    assert m.latencies["e2e"].count == m.latencies["queue_time"].count == len(PROMPTS)
    assert m.latencies["ttft"].p50 <= m.latencies["e2e"].p99
    # The Prometheus view agrees.
    assert sample(llm, "pagellm:prompt_tokens_total") == m.prompt_tokens
    assert sample(llm, "pagellm:generation_tokens_total") == m.generation_tokens
    assert sample(llm, "pagellm:prefill_tokens_total") == m.scheduler.num_prefill_tokens
    assert sample(llm, "pagellm:decode_tokens_total") == m.scheduler.num_decode_tokens
    assert sample(llm, "pagellm:request_success_total", finished_reason="length") == len(PROMPTS)
    assert sample(llm, "pagellm:time_to_first_token_seconds_count") == len(PROMPTS)
    assert sample(llm, "pagellm:iteration_tokens_sum") == m.scheduler.num_prefill_tokens + m.scheduler.num_decode_tokens
    assert sample(llm, "pagellm:request_generation_tokens_sum") == sum(MAX_TOKENS)
    for gauge in ("num_requests_running", "num_requests_waiting", "num_requests_swapped", "kv_cache_usage_perc"):
        assert sample(llm, f"pagellm:{gauge}") == 0
    assert sample(llm, "pagellm:num_free_blocks") == llm.engine.scheduler.kv_cache_manager.num_usable_blocks


def test_preemption_and_allocation_failures_are_counted(folder):
    llm = LLM(folder, max_model_len=64, num_gpu_blocks_override=7, enable_prefix_caching=False)
    run(llm, prompts=[[7] * 20] * 6, max_tokens=[30] * 6)
    stats = llm.get_metrics().scheduler
    assert stats.num_preemptions_recompute > 0 and stats.num_allocation_failures > 0
    assert sample(llm, "pagellm:num_preemptions_total", mode="recompute") == stats.num_preemptions_recompute
    assert sample(llm, "pagellm:block_allocation_failures_total") == stats.num_allocation_failures
    assert sample(llm, "pagellm:block_allocation_attempts_total") == stats.num_allocation_attempts


def test_prefix_hits_and_rejections_are_counted(folder):
    llm = LLM(folder, max_model_len=128)
    shared = list(range(3, 51))  # 3 full blocks
    run(llm, prompts=[shared + [60]], max_tokens=[2])
    run(llm, prompts=[shared + [61], shared + [62]], max_tokens=[2, 2])
    stats = llm.get_metrics().scheduler
    assert stats.num_prefix_hit_tokens == 2 * 48
    assert sample(llm, "pagellm:prefix_cache_hits_total") == 2 * 48
    assert sample(llm, "pagellm:prefix_cache_queries_total") == stats.num_prefix_query_tokens
    with pytest.raises(InvalidRequestError):
        llm.generate([[5] * 200], SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.get_metrics().rejected_requests == {"prompt": 1}
    assert sample(llm, "pagellm:request_rejected_total", reason="prompt") == 1


def test_exposition_parses_and_carries_every_metric(folder):
    llm = LLM(folder, max_model_len=128)
    run(llm)
    text = generate_latest(llm.engine.metrics.prom.registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    expected = {
        "pagellm:num_requests_running", "pagellm:num_requests_waiting", "pagellm:num_requests_swapped",
        "pagellm:kv_cache_usage_perc", "pagellm:cpu_kv_cache_usage_perc", "pagellm:num_free_blocks",
        "pagellm:prompt_tokens", "pagellm:generation_tokens", "pagellm:prefill_tokens", "pagellm:decode_tokens",
        "pagellm:prefix_cache_queries", "pagellm:prefix_cache_hits", "pagellm:num_preemptions",
        "pagellm:swapped_in_blocks", "pagellm:swapped_out_blocks", "pagellm:block_allocation_attempts",
        "pagellm:block_allocation_failures", "pagellm:request_success", "pagellm:request_rejected",
        "pagellm:time_to_first_token_seconds", "pagellm:inter_token_latency_seconds",
        "pagellm:e2e_request_latency_seconds", "pagellm:request_queue_time_seconds",
        "pagellm:request_prefill_time_seconds", "pagellm:request_decode_time_seconds",
        "pagellm:request_prompt_tokens", "pagellm:request_generation_tokens",
        "pagellm:iteration_tokens", "pagellm:iteration_requests",
        "pagellm:model_flops_utilization", "pagellm:memory_bandwidth_utilization", "pagellm:flops_ceiling",
        "pagellm:bandwidth_ceiling", "pagellm:estimated_flops", "pagellm:estimated_bytes",
    }  # fmt: skip
    assert expected <= set(families)
    for family in families.values():
        for s in family.samples:
            assert s.labels.get("model_name") == llm.engine.config.source.name


def test_stats_line_and_series_file(folder, tmp_path, caplog):
    series = tmp_path / "series.jsonl"
    llm = LLM(folder, max_model_len=128, log_stats_interval=1e-6, metrics_series_file=str(series))
    llm.engine.metrics.series_interval = 1e-6
    with caplog.at_level(logging.INFO, logger="pagellm.metrics.engine_metrics"):
        run(llm)
    lines = [r.getMessage() for r in caplog.records if "prefill:decode" in r.getMessage()]
    assert lines and "KV" in lines[0] and "prefix hit" in lines[0] and "preemptions" in lines[0]
    llm.engine.close()
    points = [json.loads(line) for line in series.read_text().splitlines()]
    assert points and {"generation_tps", "prefill_tps", "decode_tps", "kv_usage", "ttft_p50"} <= set(points[0])
    assert sum(p["running"] for p in points) > 0
    bound = [r.getMessage() for r in caplog.records if r.getMessage().startswith("bound: ")]
    assert bound and ("memory" in bound[0] and "compute" in bound[0])
    assert all("mfu" in p and "mbu" in p for p in points if p["running"])


def test_estimated_work_equals_the_steps_run(folder):
    """The engine's FLOP and byte totals are the step cost model summed over the steps
    actually scheduled (checked against the same model applied by hand)."""
    from pagellm.core.step_batch import StepBatch
    from pagellm.metrics.utilization import step_cost
    from pagellm.model.costs import ModelCosts

    llm = LLM(folder, max_model_len=128, max_num_batched_tokens=16)
    engine = llm.engine
    cost = ModelCosts.from_config(engine.model_config, dtype_bytes=DTYPE_BYTES[engine.config.dtype])
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=MAX_TOKENS[i], ignore_eos=True))
    outputs = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: outputs.append(schedule()) or outputs[-1]
    expected_flops = expected_bytes = 0.0
    while engine.has_unfinished_requests():
        # What the next step will compute, from the scheduler's own view.
        before = {rid: (r.num_computed_tokens, r.num_tokens) for rid, r in engine.scheduler.requests.items()}
        steps_before = engine.metrics.estimated_flops
        engine.step()
        assert engine.metrics.estimated_flops > steps_before
        scheduled = outputs[-1].num_scheduled_tokens
        queries = [n for n in scheduled.values()]
        seqs = [before[rid][0] + n for rid, n in scheduled.items()]
        rows = sum(before[rid][0] + n == before[rid][1] for rid, n in scheduled.items())
        step = step_cost(cost, StepBatch.from_lengths(queries, seqs, rows))
        expected_flops += step.flops
        expected_bytes += step.bytes
    assert engine.metrics.estimated_flops == pytest.approx(expected_flops)
    assert engine.metrics.estimated_bytes == pytest.approx(expected_bytes)
    assert engine.metrics.busy_seconds > 0
    assert sample(llm, "pagellm:estimated_flops_total") == pytest.approx(expected_flops)


def test_event_log_replay_matches_the_engine_at_every_step(folder, tmp_path):
    """Swap preemption, prefix hits, n > 1 forks with copy-on-write, aborts."""
    path = tmp_path / "kv.jsonl"
    llm = LLM(
        folder,
        max_model_len=64,
        num_gpu_blocks_override=10,
        preemption_mode="swap",
        swap_space=0.001,
        kv_events_file=str(path),
    )
    engine = llm.engine
    shared = list(range(3, 35))  # 2 full blocks
    for i in range(5):
        engine.add_request(f"r{i}", shared + [40 + i] * (3 + i), SamplingParams(temperature=1.0, seed=i, max_tokens=20, ignore_eos=True))
    engine.add_request("fan", shared + [90, 91, 92], SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=15, ignore_eos=True))
    snapshots = {}
    while engine.has_unfinished_requests():
        engine.step()
        snapshots[engine.num_steps] = block_map_of(engine.scheduler.kv_cache_manager).normalized()
        if engine.num_steps == 6:
            engine.abort_request("r4")
            snapshots[engine.num_steps] = block_map_of(engine.scheduler.kv_cache_manager).normalized()
    engine.close()
    events = read_events(path)
    kinds = {e["event"] for e in events}
    assert {"allocate", "free", "cache", "cache_hit", "swap_out", "swap_in", "preempt", "fork", "copy_on_write"} <= kinds
    for step, expected in snapshots.items():
        assert replay(events, until_step=step).normalized() == expected, f"step {step}"
    final = replay(events).normalized()
    assert final["device"] == {} and final["host"] == {}


def test_report_renders_png_charts(folder, tmp_path):
    pytest.importorskip("matplotlib")
    from pagellm.metrics.report import read_series, render_report

    series_path = tmp_path / "series.jsonl"
    llm = LLM(folder, max_model_len=128, metrics_series_file=str(series_path))
    llm.engine.metrics.series_interval = 1e-6
    run(llm)
    llm.engine.close()
    files = render_report(read_series(series_path), tmp_path / "charts")
    assert {f.name for f in files} == {"throughput.png", "prefill_decode.png", "kv_usage.png", "queues.png", "latency.png"}
    for f in files:
        assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f.stat().st_size > 5000


def test_cli_report_and_kv_replay(folder, tmp_path):
    import subprocess
    import sys

    series, events = tmp_path / "series.jsonl", tmp_path / "kv.jsonl"
    llm = LLM(folder, max_model_len=128, metrics_series_file=str(series), kv_events_file=str(events))
    llm.engine.metrics.series_interval = 1e-6
    run(llm)
    llm.engine.close()

    def cli(*args):
        code = f"import sys; from pagellm.entrypoints.cli import main; sys.exit(main({list(args)!r}))"
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)

    report = cli("report", str(series), "--out", str(tmp_path / "charts"))
    assert report.returncode == 0, report.stderr
    assert len(list((tmp_path / "charts").glob("*.png"))) == 5
    replayed = cli("kv-replay", str(events), "--step", "2")
    assert replayed.returncode == 0, replayed.stderr
    out = json.loads(replayed.stdout)
    assert out["summary"]["step"] == 2 and out["summary"]["blocks_in_use"] > 0
    missing = cli("kv-replay", str(tmp_path / "nope.jsonl"))
    assert missing.returncode == 1 and "cannot read the KV event log" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_abort_on_an_idle_engine_updates_the_gauges(folder):
    llm = LLM(folder, max_model_len=128)
    engine = llm.engine
    engine.add_request("a", [5] * 10, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert sample(llm, "pagellm:num_requests_running") == 1
    engine.abort_request("a")
    assert sample(llm, "pagellm:num_requests_running") == 0
    assert sample(llm, "pagellm:request_success_total", finished_reason="abort") == 1


def test_a_ceiling_that_read_low_is_raised_and_utilization_never_exceeds_one(folder, tmp_path, caplog):
    """Ceilings measured on a busy machine (here: set far too low) would print 'compute
    937%': the engine raises them to the rates it achieves, says so once, and utilization
    stays at most 100% in the stats line, the series and the gauges."""
    from pagellm.metrics.utilization import Ceilings

    llm = LLM(folder, max_model_len=128, log_stats_interval=1e-6)
    metrics = llm.engine.metrics
    metrics.series_interval = 1e-6
    metrics.ceilings = Ceilings(1.0, 1.0, "measured")  # 1 FLOP/s, 1 B/s: any step beats them
    with caplog.at_level(logging.INFO, logger="pagellm.metrics.engine_metrics"):
        run(llm)
    raised = [r for r in caplog.records if "ran faster than the device ceilings" in r.getMessage()]
    assert raised and raised[0].levelno == logging.WARNING
    assert metrics.ceilings.flops_per_s > 1.0 and "raised" in metrics.ceilings.source
    for point in metrics.series:
        if "mfu" in point:
            assert point["mfu"] <= 1.0 + 1e-9 and point["mbu"] <= 1.0 + 1e-9
    percents = [int(p.rstrip("%")) for r in caplog.records if r.getMessage().startswith("bound: ")
                for p in r.getMessage().split() if p.endswith("%")]  # fmt: skip
    assert percents and max(percents) <= 100
    llm.engine.close()


def test_memory_by_component(folder):
    """pagellm:memory_bytes: the weights, the KV cache and the rest, each from its own
    source (the checkpoint's tensors, the cache's shape), beside the resident set."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from pagellm.config.cache import kv_bytes_per_block

    llm = LLM(folder, max_model_len=128)
    run(llm)
    text = generate_latest(llm.engine.metrics.prom.registry).decode()
    values = {s.labels["component"]: s.value for f in text_string_to_metric_families(text)
              if f.name == "pagellm:memory_bytes" for s in f.samples}  # fmt: skip
    config = llm.engine.config
    model = llm.engine.executor.runner.model
    # The tiny checkpoint's float32 parameters, counted independently of the report.
    assert values["weights"] == sum(p.numel() * p.element_size() for p in model.parameters())
    blocks = config.cache_config.num_gpu_blocks
    assert values["kv_cache"] == blocks * kv_bytes_per_block(config.model_config, config.cache_config.block_size, config.kv_cache_dtype)
    # On a CPU the cache is in host memory already (no swap space); no recurrent layers, no tier.
    assert values["kv_swap_space"] == 0 and values["recurrent_state"] == 0 and values["tier_host_cache"] == 0
    assert values["process_resident"] > values["weights"]
    assert 0 < values["kv_cache_resident"] <= values["kv_cache"]  # the blocks written so far
    assert values["activations_and_other"] > 0
    llm.engine.close()


def test_each_finished_request_carries_its_own_timings_and_counts(folder):
    """RequestOutput.metrics: per request, the counts the engine's totals add up to
    (preemptions here, forced by a tiny cache), and times in order."""
    llm = LLM(folder, max_model_len=64, num_gpu_blocks_override=7, enable_prefix_caching=False)
    outputs = run(llm, prompts=[[7] * 20] * 6, max_tokens=[30] * 6)
    stats = llm.get_metrics().scheduler
    per_request = [output.metrics for output in outputs]
    assert all(m is not None for m in per_request)
    assert sum(m.num_preemptions for m in per_request) == stats.num_preemptions_recompute > 0
    for m in per_request:
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert m.num_prompt_tokens == 20 and m.num_generation_tokens == 30 and m.num_cached_tokens == 0


def test_speculation_is_counted_per_request(smollm2_path):
    """ngram speculation on a repetitive prompt: each request's drafts and accepted tokens
    add up to the engine's totals."""
    llm = LLM(str(smollm2_path), max_model_len=256, speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    prompt = "one two three four one two three four one two three four one two"
    outputs = llm.generate([prompt, prompt + " three"], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    spec = llm.get_metrics().spec_decode
    assert spec.num_proposed_tokens > 0
    assert sum(o.metrics.num_draft_tokens for o in outputs) == spec.num_proposed_tokens
    assert sum(o.metrics.num_accepted_tokens for o in outputs) == spec.num_accepted_tokens
