"""Engine stage: the synchronous engine: requests in, outputs out, one step at a time.

Each step is the engine core's (engine/core.py: schedule() -> execute -> update_from_output())
followed by output processing (detokenize, stop strings) and the metrics.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

import torch

from pagellm.attention.kv_cache_dtype import torch_dtype
from pagellm.config.cache import DTYPE_BYTES, CacheConfig, CacheSize
from pagellm.config.kv_layout import kv_bytes_per_token, kv_cache_layout
from pagellm.config.engine_args import EngineArgs
from pagellm.config.model import CLASSIFIER_ONLY, NO_CLASSIFIER, NO_LM_HEAD
from pagellm.config.engine_config import DraftModel, EngineConfig, resolve_engine_config
from pagellm.config.speculative import resolve_speculative_config
from pagellm.config.units import GiB
from pagellm.core.kv_events import KVEventLog
from pagellm.core.scheduler import Scheduler, SchedulerStats
from pagellm.core.scheduler_output import SchedulerOutput
from pagellm.engine.core import EngineCore, StepRecord
from pagellm.engine.device_probe import probe_device_facts
from pagellm.metrics.ceilings import device_ceilings
from pagellm.metrics.engine_metrics import EngineMetrics, MetricsSnapshot
from pagellm.metrics.resident_memory import StartupMemory, return_freed_heap
from pagellm.model.costs import ModelCosts
from pagellm.engine.input_processor import InputProcessor, PromptInput
from pagellm.engine.output_processor import OutputProcessor
from pagellm.errors import EngineFailedError, InvalidRequestError
from pagellm.lora.request import LoRARequest
from pagellm.model.checkpoint import load_model_config, load_tokenizer, resolve_model_source
from pagellm.outputs import RequestOutput
from pagellm.request import RequestStatus, child_request_id
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams
from pagellm.spec_decode.speculator import make_speculator
from pagellm.structured.grammar_compiler import GrammarCompiler
from pagellm.tokenizer import Tokenizer
from pagellm.executor.base import Executor, WorkerDiedError
from pagellm.executor.factory import create_executor
from pagellm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def _log_cache(config: EngineConfig, cache_config: CacheConfig, size: CacheSize) -> None:
    max_model_len = config.max_model_len
    capacity = cache_config.max_num_cached_tokens
    model_config = config.model_config
    layout = kv_cache_layout(model_config)
    global_bytes, sliding_bytes = kv_bytes_per_token(model_config, DTYPE_BYTES[config.kv_cache_dtype])
    held = f"{global_bytes:g} bytes per token of context in global layers"
    if sliding_bytes:
        held += f", {sliding_bytes:g} per token of the last window in sliding-window layers"
    if model_config.num_kv_shared_layers:
        held += f" ({model_config.num_kv_shared_layers} layers read others' K/V and hold none)"
    if model_config.linear_attention is not None:
        held += (
            f"; recurrent state (float32): {model_config.state_bytes_per_request()} bytes per request in "
            f"{len(model_config.linear_attention.layers)} linear-attention layers, {cache_config.num_state_slots} slots"
            + (f", {cache_config.num_state_snapshots} snapshots (one every {cache_config.state_snapshot_interval} blocks)"
               if cache_config.num_state_snapshots else "")
        )  # fmt: skip
    logger.info(
        "model: %s; KV cache (%s): %s; %s",
        model_config.describe(), config.kv_cache_dtype, held, layout.describe(),
    )  # fmt: skip
    logger.info(
        "KV cache: %d blocks of %d tokens = %d tokens (%.2f GiB %s per rank, %s); max concurrency at "
        "max_model_len=%d: %.2fx; swap space: %d host blocks",
        cache_config.num_usable_gpu_blocks,
        cache_config.block_size,
        capacity,
        size.kv_cache_bytes / GiB,
        str(torch_dtype(config.kv_cache_dtype)).removeprefix("torch."),
        size.how,
        max_model_len,
        # Sliding groups hold only their window's blocks, so count blocks, not tokens.
        cache_config.num_usable_gpu_blocks
        / cache_config.max_blocks_per_request(max_model_len, config.scheduler_config.max_num_batched_tokens),
        size.num_cpu_blocks,
    )


# Steps that may fail in a row (each ending its own requests) before the engine stops.
MAX_CONSECUTIVE_STEP_FAILURES = 3


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Tokenizer,
        executor: Executor,
        grammars: GrammarCompiler,
        metrics: EngineMetrics | None = None,
    ) -> None:
        self.config = config
        self.model_config = config.model_config
        self.tokenizer = tokenizer
        self.executor = executor
        assert config.cache_config is not None, "the engine needs its KV cache sized (EngineConfig.with_cache)"
        self.speculator = (
            make_speculator(config.speculative_config, config.scheduler_config.max_model_len)
            if config.speculative_config is not None
            else None
        )
        self.scheduler = Scheduler(config.scheduler_config, config.cache_config, self.speculator)
        self.executor_report = executor.describe()  # rank 0's facts, once
        # The step loop (schedule -> execute -> update), the simulator's too; a dead worker
        # ends the engine, any other error the step's requests.
        self.core = EngineCore(self.scheduler, executor, reraise=(WorkerDiedError,))
        self.last_step: StepRecord | None = None  # what the last step scheduled and computed
        self._attach_kv_tier()
        self.input_processor = InputProcessor(
            tokenizer, config.model_config.vocab_size, config.scheduler_config.max_model_len
        )
        self.output_processor = OutputProcessor(tokenizer)
        # Output constraints compile here (any thread may call compile) and the driver's
        # runner builds each request's matcher from the same cache.
        self.grammars = grammars
        # Its view of the vocabulary takes ~0.2 s to build: in the background now, rather
        # than in the way of the first constrained request.
        threading.Thread(target=self.grammars.ll_tokenizer, name="pagellm-grammar-setup", daemon=True).start()
        self.max_logprobs = config.max_logprobs
        self.metrics = metrics or EngineMetrics(config.source.name, log_stats_interval=None)
        self.sleep_level: int | None = None  # sleep(): 1 the KV cache freed, 2 the weights too
        self.num_steps = 0
        self.kv_events: KVEventLog | None = None
        if config.kv_events_file:
            self.kv_events = KVEventLog(config.kv_events_file)
            self.scheduler.kv_cache_manager.set_event_log(self.kv_events)
        self._request_counter = itertools.count()
        self._consecutive_step_failures = 0
        self._adapter_paths: dict[int, str] = {}  # lora_int_id -> the folder it was checked at

    def _attach_kv_tier(self) -> None:
        """Give the scheduler's tier index the entries the driver's store found on disk
        (or drop the index where the runner opened no store)."""
        kv = self.scheduler.kv_cache_manager
        entries = self.executor_report.kv_tier_entries
        if kv.tier is None:
            return
        if entries is None:
            kv.tier = None
            return
        kv.tier.seed(entries)

    def adapter_checked(self, lora_request: LoRARequest) -> None:
        """An adapter another thread has read and checked already (the server's load route):
        its first request does not read it again on the engine thread."""
        self._adapter_paths[lora_request.lora_int_id] = lora_request.lora_path

    def _check_adapter(self, lora_request: LoRARequest | None) -> None:
        """An adapter's folder is read once, when its id is first seen, so that a bad one is
        this request's error rather than a failed step."""
        if lora_request is None:
            return
        lora = self.config.lora_config
        if lora is None:
            raise InvalidRequestError("a LoRA adapter was asked for, but the engine runs without enable_lora", "lora_request")
        known = self._adapter_paths.get(lora_request.lora_int_id)
        if known is not None:
            if known != lora_request.lora_path:
                raise InvalidRequestError(
                    f"lora_int_id {lora_request.lora_int_id} is already the adapter at {known!r}, "
                    f"not {lora_request.lora_path!r}", "lora_request",
                )  # fmt: skip
            return
        self.read_adapter(lora_request.lora_name, lora_request.lora_path)
        self._adapter_paths[lora_request.lora_int_id] = lora_request.lora_path

    def read_adapter(self, name: str, path: str) -> None:
        """Read and check an adapter as the ranks will (LoRAAdapterError naming the problem);
        any thread may call it. Under tensor parallelism, as rank 0 cuts it: a layout the
        ranks could not cut is refused here, not in a step."""
        from pagellm.lora.adapter import load_lora_adapter
        from pagellm.model.tensor_parallel import TPLayout

        lora = self.config.lora_config
        assert lora is not None, "the engine runs without enable_lora"
        size = self.config.parallel_config.tensor_parallel_size
        layout = TPLayout.of(self.model_config, 0, size) if size > 1 else None
        load_lora_adapter(path, name, self.model_config, lora.max_lora_rank, tp=layout)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        """Wiring: load the model's config and tokenizer, probe the machine, resolve every
        setting (config/), start the ranks, size the KV cache from what they measured."""
        memory = StartupMemory()
        source = resolve_model_source(args.model)
        model_config = load_model_config(source)
        tokenizer = load_tokenizer(source, model_config)
        memory.mark("tokenizer and checkpoint metadata")
        speculative_config = resolve_speculative_config(args.speculative_config)
        draft = None
        if speculative_config is not None and speculative_config.model is not None:
            draft_source = resolve_model_source(speculative_config.model)
            draft = DraftModel(draft_source, load_model_config(draft_source))
        config = resolve_engine_config(args, source, model_config, probe_device_facts(args), draft)
        torch.manual_seed(config.seed)
        grammars = GrammarCompiler(tokenizer, model_config.vocab_size)
        executor = create_executor(config, grammars)
        memory.mark("model (weights, kernels, the largest step's buffers)")
        try:
            size = executor.cache_size()
            cache_config = config.sized_cache(size)
            _log_cache(config, cache_config, size)
            executor.init_cache(cache_config.num_gpu_blocks, cache_config.num_cpu_blocks)
            return_freed_heap()
            memory.mark("KV cache (reserved; its pages become resident as blocks are first used)")
        except BaseException:
            executor.shutdown()
            raise
        config = config.with_cache(cache_config)
        metrics = EngineMetrics(
            source.name, log_stats_interval=config.log_stats_interval, series_file=config.metrics_series_file
        )
        metrics.set_utilization_model(
            ModelCosts.from_config(
                model_config, dtype_bytes=DTYPE_BYTES[config.dtype], kv_dtype_bytes=DTYPE_BYTES[config.kv_cache_dtype]
            ),
            device_ceilings(config.device_type, torch_dtype(config.dtype)),
            config.scheduler_config.max_num_seqs,
        )
        global_bytes, _ = kv_bytes_per_token(model_config, DTYPE_BYTES[config.kv_cache_dtype])
        metrics.set_cache_shape(
            int(global_bytes), model_config.state_bytes_per_request(),
            cache_config.num_state_slots, cache_config.num_state_snapshots,
        )  # fmt: skip
        engine = cls(config, tokenizer, executor, grammars, metrics)
        metrics.set_memory(dict(engine.executor_report.memory), config.device_type)
        if engine.executor_report.cpu_kernels is not None:  # bf16 CPU models
            metrics.set_cpu_kernels(engine.executor_report.cpu_kernels)
        breakdown = memory.describe()
        if breakdown is not None:
            logger.info("memory: %s", breakdown)
        return engine

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str | None,
        prompt: PromptInput,
        params: SamplingParams | PoolingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        background: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Queue a request; returns its id. Raises InvalidRequestError if it can never run.
        With PoolingParams it is an embedding request: its prompt is pooled, nothing sampled.
        A background request (a batch line) runs only where the others leave room.
        lora_request: the adapter it runs under (with enable_lora), read and checked here
        the first time its id is seen."""
        if self.sleep_level is not None:  # a request wakes a sleeping engine: it waits, never fails
            self.wake_up()
        pooling = None
        if isinstance(params, PoolingParams):
            config = self.model_config
            if params.task == "classify" and not config.num_labels:
                self.metrics.request_rejected("model")
                raise InvalidRequestError(NO_CLASSIFIER, "model")
            pooling = params.resolved(
                config.pooling_type, config.hidden_size, config.is_matryoshka, config.matryoshka_dimensions
            )
            params = SamplingParams(max_tokens=None)
        elif not self.model_config.has_lm_head:
            self.metrics.request_rejected("model")
            raise InvalidRequestError(CLASSIFIER_ONLY if self.model_config.num_labels else NO_LM_HEAD, "model")
        params = params or SamplingParams()
        if request_id is None:
            request_id = f"req-{next(self._request_counter)}"
        if request_id in self.scheduler.requests or self.output_processor.has_request(request_id):
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        try:
            params.check_against_model(self.model_config.vocab_size, self.max_logprobs)
            if params.structured_outputs is not None:
                self.grammars.compile(params.structured_outputs)  # a cache hit when pre-compiled
            self._check_adapter(lora_request)
            prompt_text, prompt_ids = self.input_processor.tokenize(prompt)
            request = self.input_processor.make_request(
                request_id, prompt_ids, params, arrival_time, priority, pooling, background, lora_request
            )
            self.scheduler.add_request(request)
        except InvalidRequestError as e:
            self.metrics.request_rejected(e.parameter or "invalid")
            raise
        self.output_processor.add_request(request_id, prompt_text, prompt_ids, params)
        self.metrics.request_added(request_id, len(prompt_ids), time.time())
        return request_id

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Abort requests (all their completions) in any state; blocks are freed at once."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        scheduler_ids = [sid for rid in ids for sid in self.output_processor.scheduler_ids(rid)]
        self.scheduler.finish_requests(
            [sid for sid in scheduler_ids if sid in self.scheduler.requests],
            RequestStatus.FINISHED_ABORTED,
        )
        outputs = [o for o in (self.output_processor.abort(rid) for rid in ids) if o is not None]
        self.metrics.record_finished_stats(self.scheduler.take_finished_stats())
        self.metrics.record_outputs(outputs, time.time())
        # Gauges otherwise move only when the engine steps; an idle engine would keep
        # showing the aborted requests.
        self.metrics.update_scheduler_metrics(self.scheduler.make_stats())
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    # ---------------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns the requests that progressed (or finished)."""
        started = time.perf_counter()
        started_wall = time.time()
        self.num_steps += 1
        if self.kv_events is not None:
            self.kv_events.step = self.num_steps
        record = self.core.step()
        self.last_step = record
        if record.failed:
            return self._fail_step(record.scheduler_output, record.error)
        runner_output = record.runner_output
        try:
            result = self.output_processor.process(
                record.progress, runner_output.logprobs, runner_output.prompt_logprobs, record.cached_tokens,
                runner_output.pooled,
            )  # fmt: skip
        except Exception as error:  # noqa: BLE001 - one step's failure ends its requests, not the engine
            return self._fail_step(record.scheduler_output, error)
        self._consecutive_step_failures = 0
        if result.stopped_req_ids:
            # A stop string ended these completions: free their blocks now.
            self.scheduler.finish_requests(result.stopped_req_ids, RequestStatus.FINISHED_STOPPED)
        self.metrics.record_structured_outputs(*self.grammars.take_stats(), runner_output.mask_seconds)
        self.metrics.record_lora(runner_output.num_lora_loads, runner_output.num_lora_evictions)
        scheduler_output = record.scheduler_output
        if self.speculator is not None:
            self.speculator.observe_step(scheduler_output.total_num_scheduled_tokens, time.perf_counter() - started)
            self.metrics.record_speculation(*self.speculator.take_new())
        self.metrics.record_finished_stats(self.scheduler.take_finished_stats())
        self.metrics.record_step(
            scheduler_output,
            result.outputs,
            self.scheduler.make_stats(),
            time.time(),
            work=record.batch,
            step_seconds=time.perf_counter() - started,
            started=started_wall,
        )
        if self.kv_events is not None:
            self.kv_events.flush()
        if not self.scheduler.has_unfinished_requests() and self.scheduler.has_unsent_tier_work():
            self._flush_tier()
        return result.outputs

    def _flush_tier(self) -> None:
        """The engine goes idle with blocks or snapshots the tier should hold that no step
        sent yet (those of the steps just run): an empty step sends them, so a restart
        finds the end of the last conversation too."""
        record = self.core.step()
        if record.failed:
            logger.warning("the step sending the last writes to the prefix-cache tier failed: %r", record.error)
            self.scheduler.fail_step(record.scheduler_output)

    def _fail_step(self, scheduler_output: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        """A step raised (model forward, sampler, detokenizer, grammar): end the requests
        it computed or preempted, all completions of each, free their blocks, and carry
        on with the others. Their state in the runner and scheduler may be half-updated;
        ending them is what keeps everyone else's exact. Several failures in a row, or
        one with tensor parallelism (the ranks may have diverged), stop the engine."""
        self._consecutive_step_failures += 1
        logger.error("step %d failed; its requests are ended", self.num_steps, exc_info=error)
        if self._consecutive_step_failures >= MAX_CONSECUTIVE_STEP_FAILURES or not self.executor.can_recover_from_step_failures:
            raise EngineFailedError(
                f"{self._consecutive_step_failures} engine step(s) failed in a row, the last with {error!r}"
            ) from error
        message = f"the engine step computing this request failed ({type(error).__name__}: {error})"
        outputs: list[RequestOutput] = []
        for scheduler_id in self.scheduler.fail_step(scheduler_output):
            output = self.output_processor.fail(scheduler_id, message)
            if output is None:
                continue  # a completion of a request already ended
            # Its other completions (n > 1) end with it, wherever they are.
            siblings = [child_request_id(output.request_id, i) for i in range(1, len(output.outputs))]
            self.scheduler.finish_requests(
                [i for i in [output.request_id, *siblings] if i in self.scheduler.requests], RequestStatus.FINISHED_ABORTED
            )
            outputs.append(output)
        self.metrics.record_failed_step(len(outputs))
        self.metrics.record_finished_stats(self.scheduler.take_finished_stats())
        self.metrics.record_outputs(outputs, time.time())
        self.metrics.update_scheduler_metrics(self.scheduler.make_stats())
        return outputs

    @property
    def model_name(self) -> str:
        """The checkpoint's name (what metrics and the dashboard label figures with)."""
        return self.config.source.name

    @property
    def runner(self) -> ModelRunner:
        """The driver's runner (rank 0: its model share, its KV cache)."""
        return self.executor.runner

    # --------------------------------------------------------------------- sleep

    def sleep(self, level: int = 1) -> None:
        """Free memory while idle: level 1 the KV cache (and the runner's states and step
        buffers), level 2 the weights too (wake_up loads them again from the checkpoint).
        What the device's prefix cache held is forgotten; the disk tier's entries stay
        (its queued writes are sent and written first). A new request wakes the engine."""
        if level not in (1, 2):
            raise InvalidRequestError(f"level must be 1 or 2, got {level}", "level")
        if self.has_unfinished_requests():
            raise InvalidRequestError("the engine has requests in flight; it can sleep once they finish", "level")
        if self.sleep_level is not None and self.sleep_level >= level:
            return
        if self.scheduler.has_unsent_tier_work():
            self._flush_tier()
        self.scheduler.kv_cache_manager.forget_device_contents()
        self.executor.sleep(level)
        self.sleep_level = level
        self.metrics.prom.sleep_level.set(level)
        logger.info("asleep (level %d): %s freed", level, "the KV cache" if level == 1 else "the KV cache and the weights")

    def wake_up(self) -> None:
        """Load back what sleep freed; the engine serves as before (a no-op when awake)."""
        if self.sleep_level is None:
            return
        started = time.perf_counter()
        self.executor.wake_up()
        logger.info("awake (from level %d) in %.2f s", self.sleep_level, time.perf_counter() - started)
        self.sleep_level = None
        self.metrics.prom.sleep_level.set(0)

    def close(self) -> None:
        """Stop the workers and release files the engine writes (event log, metrics series)."""
        self.executor.shutdown()
        if self.kv_events is not None:
            self.kv_events.close()
        self.metrics.close()

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def get_metrics(self) -> MetricsSnapshot:
        """Counters, gauges and latency summaries since the engine started."""
        return self.metrics.snapshot(self.scheduler.make_stats())
