"""Worker stage: one rank's model share, KV cache and runner, built from the engine's settings.

The engine (driver) resolves every setting once into a `WorkerSpec`, which is all a rank
needs, in this process or another one. Each rank then:

1. loads its share of the model (`Worker(spec, rank, device)`),
2. joins the tensor-parallel group (`connect`, size > 1 only),
3. says how many KV blocks its memory holds (`cache_size`: the minimum over ranks, since
   every rank holds the same block ids for its own heads),
4. allocates them (`init_cache`) and then executes every step the driver schedules.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from pagellm.attention.selector import get_attention_backend
from pagellm.config import SchedulerConfig
from pagellm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagellm.model.config import ModelConfig
from pagellm.model.loader import ModelSource, load_model
from pagellm.model.tensor_parallel import TPLayout
from pagellm.spec_decode.draft_model import DraftModelProposer
from pagellm.worker.cache_sizing import GiB, CacheSize, decide_cache_size
from pagellm.worker.cuda_graphs import DEFAULT_MAX_CAPTURE_BATCH_SIZE, capture_sizes
from pagellm.worker.distributed import DistributedTPGroup
from pagellm.worker.kv_cache import kv_cache_bytes_per_block
from pagellm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """Every resolved setting a rank needs (picklable: it travels to worker processes)."""

    source: ModelSource
    model_config: ModelConfig  # the full model
    scheduler_config: SchedulerConfig
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    block_size: int
    seed: int = 0
    attention_backend: str = "auto"
    load_format: str = "auto"
    quantization: str = "auto"
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    swap_space_bytes: int = 0  # host memory for swapped-out blocks (swap preemption only)
    enforce_eager: bool = False
    max_capture_batch_size: int | None = None  # None: min(max_num_seqs, 512)
    tensor_parallel_size: int = 1
    num_threads: int | None = None  # CPU threads per rank (None: torch's default)
    # Speculative decoding's draft model (tensor_parallel_size 1 only): its own weights
    # and a KV cache addressed by the target's block ids.
    draft_source: ModelSource | None = None
    draft_model_config: ModelConfig | None = None


@dataclass(frozen=True)
class StepMessage:
    """What the driver sends every other rank each step: the schedule, plus the tokens
    the driver sampled last step (only the driver samples; the other ranks need the
    tokens to feed them back in)."""

    scheduler_output: SchedulerOutput
    sampled_token_ids: dict[str, list[int]]


def decode_graph_sizes(
    device: torch.device,
    attention_backend: str,
    *,
    enforce_eager: bool,
    max_capture_batch_size: int | None,
    max_num_seqs: int,
    tensor_parallel_size: int = 1,
) -> list[int]:
    """Decode batch sizes to capture as CUDA graphs: none on CPU, with --enforce-eager,
    where attention does not run through the Triton kernels (whose plans graphs replay),
    or with tensor parallelism (its collectives are not captured)."""
    if device.type != "cuda" or enforce_eager or attention_backend != "triton" or tensor_parallel_size > 1:
        return []
    return capture_sizes(max_capture_batch_size or min(max_num_seqs, DEFAULT_MAX_CAPTURE_BATCH_SIZE))


class Worker:
    def __init__(self, spec: WorkerSpec, rank: int, device: torch.device) -> None:
        self.spec = spec
        self.rank = rank
        self.device = device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        # torch's thread count is the process's: the driver's share of the cores holds
        # until close() gives the process its own count back.
        self._previous_threads = torch.get_num_threads()
        if spec.num_threads is not None and device.type == "cpu":
            torch.set_num_threads(spec.num_threads)
        torch.manual_seed(spec.seed)
        self.tp: DistributedTPGroup | None = None
        if spec.tensor_parallel_size > 1:
            self.tp = DistributedTPGroup(TPLayout.of(spec.model_config, rank, spec.tensor_parallel_size))
        self.backend = get_attention_backend(spec.attention_backend, device)
        self.model = load_model(
            spec.source, spec.model_config, self.backend, spec.dtype, device, spec.load_format, spec.quantization, self.tp
        )  # fmt: skip
        self.draft_model = None
        if spec.draft_source is not None:
            assert spec.draft_model_config is not None and self.tp is None
            self.draft_model = load_model(
                spec.draft_source, spec.draft_model_config, self.backend, spec.dtype, device, "auto", "auto"
            )
        self.runner: ModelRunner | None = None

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def connect(self, init_method: str) -> None:
        assert self.tp is not None
        self.tp.connect(init_method, self.device)

    def graph_sizes(self) -> list[int]:
        spec = self.spec
        return decode_graph_sizes(
            self.device,
            self.backend.name,
            enforce_eager=spec.enforce_eager,
            max_capture_batch_size=spec.max_capture_batch_size,
            max_num_seqs=spec.scheduler_config.max_num_seqs,
            tensor_parallel_size=spec.tensor_parallel_size,
        )

    def cache_size(self) -> CacheSize:
        """How many blocks this rank's memory holds; with tensor parallelism the minimum
        over ranks (a collective: every rank calls it)."""
        spec = self.spec
        config = self.model.config  # this rank's heads
        bytes_per_block = kv_cache_bytes_per_block(config, spec.block_size, spec.kv_cache_dtype)
        if self.draft_model is not None:  # a block holds the draft's K/V of its positions too
            bytes_per_block += kv_cache_bytes_per_block(self.draft_model.config, spec.block_size, spec.kv_cache_dtype)
        peak = None
        if self.device.type == "cuda" and spec.num_gpu_blocks_override is None and spec.kv_cache_memory_bytes is None:
            from pagellm.worker.profiling import profile_memory

            sizes = self.graph_sizes()
            profile = profile_memory(
                self.model, spec.scheduler_config, spec.block_size, spec.kv_cache_dtype, self.device,
                graph_batch_size=max(sizes) if sizes else None,
            )  # fmt: skip
            peak = profile.total_bytes
        size = decide_cache_size(
            bytes_per_block=bytes_per_block,
            device=self.device,
            gpu_memory_utilization=spec.gpu_memory_utilization,
            kv_cache_memory_bytes=spec.kv_cache_memory_bytes,
            num_gpu_blocks_override=spec.num_gpu_blocks_override,
            swap_space_bytes=spec.swap_space_bytes,
            profiled_peak_bytes=peak,
        )
        if self.tp is None:
            return size
        num_gpu = self.tp.min_over_ranks(size.num_gpu_blocks)
        num_cpu = self.tp.min_over_ranks(size.num_cpu_blocks)
        how = size.how if num_gpu == size.num_gpu_blocks else f"{size.how}; the smallest over {self.tp.layout.size} ranks"
        return replace(size, num_gpu_blocks=num_gpu, num_cpu_blocks=num_cpu, how=how)

    def init_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.runner = ModelRunner(
            self.model,
            self.spec.block_size,
            num_gpu_blocks,
            num_cpu_blocks,
            self.spec.kv_cache_dtype,
            self.device,
            is_driver=self.is_driver,
        )
        if self.draft_model is not None:
            self.runner.draft = DraftModelProposer(
                self.draft_model, num_gpu_blocks, self.spec.block_size, self.spec.kv_cache_dtype, self.device
            )
        sizes = self.graph_sizes()
        if sizes:
            reserved = torch.cuda.memory_reserved(self.device)
            self.runner.capture_decode_graphs(sizes, self.spec.scheduler_config.max_model_len)
            logger.info("CUDA graphs hold %.2f GiB", (torch.cuda.memory_reserved(self.device) - reserved) / GiB)

    def execute_model(
        self, scheduler_output: SchedulerOutput, sampled_token_ids: dict[str, list[int]] | None = None
    ) -> ModelRunnerOutput:
        assert self.runner is not None, "init_cache first"
        if sampled_token_ids:
            self.runner.append_sampled(sampled_token_ids)
        return self.runner.execute_model(scheduler_output)

    def close(self) -> None:
        if self.tp is not None:
            self.tp.close()
        torch.set_num_threads(self._previous_threads)
