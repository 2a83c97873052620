"""Engine stage: the synchronous step loop that ties scheduler, runner and outputs.

Each step is: schedule() -> runner.execute_model() -> update_from_output() -> outputs.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass

import torch

from pagellm.config import CacheConfig, SchedulerConfig, SpeculativeConfig, resolve_speculative_config
from pagellm.core.kv_events import KVEventLog
from pagellm.core.scheduler import Scheduler, SchedulerStats
from pagellm.core.scheduler_output import SchedulerOutput
from pagellm.metrics.ceilings import device_ceilings
from pagellm.model.linear_plans import kernel_info
from pagellm.metrics.engine_metrics import EngineMetrics, MetricsSnapshot
from pagellm.metrics.utilization import StepWork
from pagellm.model.costs import ModelCosts
from pagellm.engine.arg_utils import DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineArgs
from pagellm.engine.input_processor import InputProcessor, PromptInput
from pagellm.engine.output_processor import OutputProcessor
from pagellm.errors import ConfigError, EngineFailedError, InvalidRequestError
from pagellm.model.config import ModelConfig
from pagellm.model.loader import (
    ModelSource,
    load_model_config,
    load_tokenizer,
    resolve_model_source,
)
from pagellm.outputs import RequestOutput
from pagellm.request import RequestStatus, child_request_id
from pagellm.sampling_params import SamplingParams
from pagellm.spec_decode.speculator import make_speculator
from pagellm.structured.grammar_compiler import GrammarCompiler
from pagellm.tokenizer import Tokenizer
from pagellm.attention.kv_cache_dtype import resolve_kv_cache_dtype
from pagellm.executor.base import Executor, WorkerDiedError
from pagellm.executor.factory import create_executor
from pagellm.model.tensor_parallel import check_tp_size
from pagellm.worker.cache_sizing import GiB
from pagellm.worker.model_runner import ModelRunner
from pagellm.worker.worker import WorkerSpec

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    """Every resolved setting of a running engine."""

    source: ModelSource
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    device: torch.device
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype  # dtype, or fp8 (--kv-cache-dtype)
    speculative_config: SpeculativeConfig | None = None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' was asked for, but no CUDA device is available")
    return torch.device(name)


def cpu_runs_native_kernels() -> bool:
    """Whether pagellm's C kernels run bf16 models on this CPU (x86-64 with AVX2 and a C
    compiler; kernels/build.py picks the build by CPUID)."""
    from pagellm.kernels.linear import cpu_linear_kernels

    return cpu_linear_kernels() is not None


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """"auto": bfloat16 on GPUs and on CPUs where the native kernels run, else float32.

    On CPU bf16 is what the kernels read (a GGUF stays quantized only there); they compute in
    bf16 where the CPU has AVX-512 BF16 or AMX and in float32 on bf16 inputs on AVX2, and
    bf16 is faster on both (docs/performance.md: on the AVX2 build 3.9x float32 single
    stream).

    PAGELLM_CPU_DTYPE=float32 pins the CPU choice (the tests do: float32 is the
    exactness reference against HF transformers).
    """
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16
    forced = os.environ.get("PAGELLM_CPU_DTYPE")
    if forced:
        if forced not in _DTYPES:
            raise ConfigError(f"PAGELLM_CPU_DTYPE must be one of {sorted(_DTYPES)}, got {forced!r}")
        return _DTYPES[forced]
    return torch.bfloat16 if cpu_runs_native_kernels() else torch.float32


def resolve_max_model_len(args: EngineArgs, model_config: ModelConfig) -> int:
    model_max = model_config.max_position_embeddings
    if model_config.sliding_window is not None:
        # Without sliding-window attention, results are exact only within the window.
        model_max = min(model_max, model_config.sliding_window)
    if args.max_model_len is None:
        return model_max
    if args.max_model_len > model_max:
        raise ConfigError(
            f"max_model_len={args.max_model_len} exceeds what the model supports ({model_max})"
        )
    return args.max_model_len


def _size_cache(executor: Executor, args: EngineArgs, max_model_len: int, kv_cache_dtype: torch.dtype) -> CacheConfig:
    """The KV cache every rank can hold; too small for one max_model_len request is an error."""
    size = executor.cache_size()
    cache_config = CacheConfig(
        block_size=args.block_size,
        num_gpu_blocks=size.num_gpu_blocks,
        num_cpu_blocks=size.num_cpu_blocks,
        enable_prefix_caching=args.enable_prefix_caching,
    )
    capacity = cache_config.max_num_cached_tokens
    # A request of max_model_len needs ceil(len / block) whole blocks.
    blocks_per_max_request = -(-max_model_len // args.block_size)
    if blocks_per_max_request > cache_config.num_usable_gpu_blocks:
        raise ConfigError(
            f"the KV cache ({size.how}) holds {capacity} tokens, too few for one request "
            f"of max_model_len={max_model_len}; the largest max_model_len that fits is "
            f"{capacity}. Lower max_model_len or give the cache more memory."
        )
    logger.info(
        "KV cache: %d blocks of %d tokens = %d tokens (%.2f GiB %s per rank, %s); max concurrency at "
        "max_model_len=%d: %.2fx; swap space: %d host blocks",
        cache_config.num_usable_gpu_blocks,
        args.block_size,
        capacity,
        size.kv_cache_bytes / GiB,
        str(kv_cache_dtype).removeprefix("torch."),
        size.how,
        max_model_len,
        capacity / max_model_len,
        size.num_cpu_blocks,
    )
    return cache_config


def _resolve_draft_model(
    path: str, target: ModelConfig, max_model_len: int, tensor_parallel_size: int
) -> tuple[ModelSource, ModelConfig]:
    """The draft model of speculative decoding: it must share the target's vocabulary
    (its tokens are proposed as the target's) and reach max_model_len."""
    if tensor_parallel_size > 1:
        raise ConfigError("speculative_config: a draft model runs with tensor_parallel_size 1 only")
    source = resolve_model_source(path)
    config = load_model_config(source)
    if config.vocab_size != target.vocab_size:
        raise ConfigError(
            f"speculative_config: the draft model {source.name!r} has a vocabulary of {config.vocab_size} tokens, "
            f"the target {target.vocab_size}: a draft must use the target's tokenizer"
        )
    if config.max_position_embeddings < max_model_len:
        raise ConfigError(
            f"speculative_config: the draft model {source.name!r} reaches {config.max_position_embeddings} "
            f"positions, less than max_model_len={max_model_len}"
        )
    return source, config


# Steps that may fail in a row (each ending its own requests) before the engine stops.
MAX_CONSECUTIVE_STEP_FAILURES = 3


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Tokenizer,
        executor: Executor,
        max_logprobs: int = 20,
        metrics: EngineMetrics | None = None,
        kv_events_file: str | None = None,
    ) -> None:
        self.config = config
        self.model_config = config.model_config
        self.tokenizer = tokenizer
        self.executor = executor
        self.speculator = (
            make_speculator(config.speculative_config, config.scheduler_config.max_model_len)
            if config.speculative_config is not None
            else None
        )
        self.scheduler = Scheduler(config.scheduler_config, config.cache_config, self.speculator)
        self.input_processor = InputProcessor(
            tokenizer, config.model_config.vocab_size, config.scheduler_config.max_model_len
        )
        self.output_processor = OutputProcessor(tokenizer)
        # Output constraints compile here (any thread may call compile) and the driver's
        # runner builds each request's matcher from the same cache.
        self.grammars = GrammarCompiler(tokenizer, config.model_config.vocab_size)
        executor.runner.grammars = self.grammars
        # Its view of the vocabulary takes ~0.2 s to build: in the background now, rather
        # than in the way of the first constrained request.
        threading.Thread(target=self.grammars.ll_tokenizer, name="pagellm-grammar-setup", daemon=True).start()
        self.max_logprobs = max_logprobs
        self.metrics = metrics or EngineMetrics(config.source.name, log_stats_interval=None)
        self.num_steps = 0
        self.kv_events: KVEventLog | None = None
        if kv_events_file:
            self.kv_events = KVEventLog(kv_events_file)
            self.scheduler.kv_cache_manager.set_event_log(self.kv_events)
        self._request_counter = itertools.count()
        self._consecutive_step_failures = 0

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        args = args.with_profile()
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
        torch.manual_seed(args.seed)
        source = resolve_model_source(args.model)
        model_config = load_model_config(source)
        tokenizer = load_tokenizer(source, model_config)
        max_model_len = resolve_max_model_len(args, model_config)
        max_num_batched_tokens = args.max_num_batched_tokens
        if max_num_batched_tokens is None:
            max_num_batched_tokens = (
                DEFAULT_MAX_NUM_BATCHED_TOKENS if args.enable_chunked_prefill else max_model_len
            )
        scheduler_config = SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=args.enable_chunked_prefill,
            scheduling_policy=args.scheduling_policy,  # type: ignore[arg-type]
            preemption_mode=args.preemption_mode,  # type: ignore[arg-type]
            max_num_partial_prefills=args.max_num_partial_prefills,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            prefill_share=1.0 if args.prefill_share is None else args.prefill_share,
        )
        # fp8 caches take 1 byte per element: twice the blocks of bf16 in the same budget.
        kv_cache_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, dtype)
        tp_size = args.tensor_parallel_size
        if tp_size > 1:
            check_tp_size(model_config, tp_size)
        speculative_config = resolve_speculative_config(args.speculative_config)
        draft_source, draft_config = None, None
        if speculative_config is not None and speculative_config.model is not None:
            draft_source, draft_config = _resolve_draft_model(speculative_config.model, model_config, max_model_len, tp_size)
        spec = WorkerSpec(
            source=source,
            model_config=model_config,
            scheduler_config=scheduler_config,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            block_size=args.block_size,
            seed=args.seed,
            attention_backend=args.attention_backend,
            load_format=args.load_format,
            quantization=args.quantization,
            gpu_memory_utilization=args.gpu_memory_utilization,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            num_gpu_blocks_override=args.num_gpu_blocks_override,
            # Host blocks are only ever used by swap preemption.
            swap_space_bytes=int(args.swap_space * GiB) if args.preemption_mode == "swap" else 0,
            enforce_eager=args.enforce_eager,
            max_capture_batch_size=args.max_capture_batch_size,
            tensor_parallel_size=tp_size,
            # CPU ranks share the machine's cores.
            num_threads=max(1, torch.get_num_threads() // tp_size) if tp_size > 1 and device.type == "cpu" else None,
            draft_source=draft_source,
            draft_model_config=draft_config,
        )
        executor = create_executor(spec, args.distributed_executor_backend, device)
        try:
            cache_config = _size_cache(executor, args, max_model_len, kv_cache_dtype)
            executor.init_cache(cache_config.num_gpu_blocks, cache_config.num_cpu_blocks)
        except BaseException:
            executor.shutdown()
            raise
        config = EngineConfig(
            source, model_config, cache_config, scheduler_config, device, dtype, kv_cache_dtype, speculative_config,
        )  # fmt: skip
        metrics = EngineMetrics(
            source.name,
            log_stats_interval=None if args.disable_log_stats else args.log_stats_interval,
            series_file=args.metrics_series_file,
        )
        metrics.set_utilization_model(
            ModelCosts.from_config(model_config, dtype_bytes=dtype.itemsize, kv_dtype_bytes=kv_cache_dtype.itemsize),
            device_ceilings(device.type, dtype),
            scheduler_config.max_num_seqs,
        )
        info = kernel_info(getattr(getattr(executor, "runner", None), "model", None))
        if info is not None:  # in-process bf16 CPU models
            metrics.set_cpu_kernels(info)
        return cls(config, tokenizer, executor, args.max_logprobs, metrics, args.kv_events_file)

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str | None,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> str:
        """Queue a request; returns its id. Raises InvalidRequestError if it can never run."""
        params = params or SamplingParams()
        if request_id is None:
            request_id = f"req-{next(self._request_counter)}"
        if request_id in self.scheduler.requests or self.output_processor.has_request(request_id):
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        try:
            params.check_against_model(self.model_config.vocab_size, self.max_logprobs)
            if params.structured_outputs is not None:
                self.grammars.compile(params.structured_outputs)  # a cache hit when pre-compiled
            prompt_text, prompt_ids = self.input_processor.tokenize(prompt)
            request = self.input_processor.make_request(
                request_id, prompt_ids, params, arrival_time, priority
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
        self.num_steps += 1
        if self.kv_events is not None:
            self.kv_events.step = self.num_steps
        scheduler_output = self.scheduler.schedule()
        work = self._step_work(scheduler_output)
        # Prefix-cache hits are decided when a request is (re)admitted, i.e. sent new.
        cached = {
            new.req_id: self.scheduler.requests[new.req_id].num_cached_tokens
            for new in scheduler_output.scheduled_new_reqs
        }
        try:
            runner_output = self.executor.execute_model(scheduler_output)
            progress = self.scheduler.update_from_output(scheduler_output, runner_output)
            result = self.output_processor.process(
                progress, runner_output.logprobs, runner_output.prompt_logprobs, cached
            )
        except WorkerDiedError:
            raise
        except Exception as error:  # noqa: BLE001 - one step's failure ends its requests, not the engine
            return self._fail_step(scheduler_output, error)
        self._consecutive_step_failures = 0
        if result.stopped_req_ids:
            # A stop string ended these completions: free their blocks now.
            self.scheduler.finish_requests(result.stopped_req_ids, RequestStatus.FINISHED_STOPPED)
        self.metrics.record_structured_outputs(*self.grammars.take_stats(), self.runner.mask_timer.take())
        if self.speculator is not None:
            self.speculator.observe_step(scheduler_output.total_num_scheduled_tokens, time.perf_counter() - started)
            self.metrics.record_speculation(*self.speculator.take_new())
        self.metrics.record_step(
            scheduler_output,
            result.outputs,
            self.scheduler.make_stats(),
            time.time(),
            work=work,
            step_seconds=time.perf_counter() - started,
        )
        if self.kv_events is not None:
            self.kv_events.flush()
        return result.outputs

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
        self.metrics.record_outputs(outputs, time.time())
        self.metrics.update_scheduler_metrics(self.scheduler.make_stats())
        return outputs

    def _step_work(self, scheduler_output: SchedulerOutput) -> StepWork:
        """What this step computes (read before update_from_output moves the counts)."""
        query_lens, seq_lens, logit_rows = [], [], 0
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.scheduler.requests[request_id]
            seq_len = request.num_computed_tokens + num_tokens
            query_lens.append(num_tokens)
            seq_lens.append(seq_len)
            proposal = scheduler_output.scheduled_spec_decode_tokens.get(request_id)
            # A verification computes logits at all its k + 1 positions.
            logit_rows += len(proposal) + 1 if proposal else seq_len == request.num_tokens
        return StepWork.from_batch(query_lens, seq_lens, logit_rows)

    @property
    def model_name(self) -> str:
        """The checkpoint's name (what metrics and the dashboard label figures with)."""
        return self.config.source.name

    @property
    def runner(self) -> ModelRunner:
        """The driver's runner (rank 0: its model share, its KV cache)."""
        return self.executor.runner

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
