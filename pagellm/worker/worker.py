"""Worker stage: one rank's model share, KV cache and runner, built from the engine's config.

The engine (driver) resolves every setting once into an `EngineConfig` (config/), which
is all a rank needs, in this process or another one. Each rank then:

1. loads its share of the model (`Worker(config, rank, device)`),
2. joins the tensor-parallel group (`connect`, size > 1 only),
3. says how many KV blocks its memory holds (`cache_size`: the minimum over ranks, since
   every rank holds the same block ids for its own heads),
4. allocates them (`init_cache`) and then executes every step the driver schedules.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagellm.attention.kv_cache_dtype import torch_dtype
from pagellm.attention.selector import get_attention_backend
from pagellm.config.cache import CacheSize, MemoryFacts, decide_cache_size, kv_bytes_per_block
from pagellm.config.engine_config import EngineConfig
from pagellm.config.units import GiB
from pagellm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagellm.errors import InvalidRequestError
from pagellm.metrics.resident_memory import return_freed_heap
from pagellm.model.loader import load_model
from pagellm.model.tensor_parallel import TPLayout
from pagellm.spec_decode.draft_model import DraftModelProposer
from pagellm.structured.grammar_compiler import GrammarCompiler
from pagellm.worker.memory import available_ram_bytes
from pagellm.worker.step_paths.cuda_graphs import DEFAULT_MAX_CAPTURE_BATCH_SIZE, capture_sizes
from pagellm.worker.distributed import DistributedTPGroup
from pagellm.worker.model_runner import ModelRunner
from pagellm.worker.kv_tier_store import TierIdentity, TierStore

if TYPE_CHECKING:
    from pagellm.lora.slots import LoRAManager

logger = logging.getLogger(__name__)

# The tier's host-memory cache when the KV cache is on a GPU and the user set none.
DEFAULT_KV_OFFLOAD_HOST_BYTES = 4 * GiB


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


def with_device_index(device: torch.device) -> torch.device:
    """A CUDA device with its index: torch.cuda.set_device refuses a bare "cuda" (torch
    2.11 and later), so a single rank takes the current device. Others pass through."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class Worker:
    def __init__(
        self, config: EngineConfig, rank: int, device: torch.device, grammars: GrammarCompiler | None = None
    ) -> None:
        self.config = config
        # A hybrid's recurrent-state slots: max_num_seqs until cache_size() says how many fit.
        self._num_state_slots = config.num_state_slots
        # Structured outputs' compiler (the engine's, shared with its input checks): only
        # the driver, which samples, holds one.
        self.grammars = grammars
        self.rank = rank
        device = with_device_index(device)
        self.device = device
        self.dtype = torch_dtype(config.dtype)
        self.kv_cache_dtype = torch_dtype(config.kv_cache_dtype)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        # torch's thread count is the process's: the driver's share of the cores holds
        # until close() gives the process its own count back.
        self._previous_threads = torch.get_num_threads()
        parallel = config.parallel_config
        if parallel.num_threads_per_rank is not None and device.type == "cpu":
            torch.set_num_threads(parallel.num_threads_per_rank)
        torch.manual_seed(config.seed)
        self.tp: DistributedTPGroup | None = None
        if parallel.tensor_parallel_size > 1:
            self.tp = DistributedTPGroup(TPLayout.of(config.model_config, rank, parallel.tensor_parallel_size))
        self.backend = get_attention_backend(config.attention_backend, device)
        self.model = self._load_model()
        # --enable-lora: the adapters' slots, handed to the model's linear layers here.
        self.lora_manager: LoRAManager | None = None
        if config.lora_config is not None:
            from pagellm.lora.slots import LoRAManager

            lora = config.lora_config
            layout = None if self.tp is None else self.tp.layout
            self.lora_manager = LoRAManager(
                self.model, config.model_config, lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras, layout
            )
        self.draft_model = None
        if config.draft is not None:
            assert self.tp is None
            self.draft_model = self._load_draft_model()
        self.runner: ModelRunner | None = None
        self._cache_blocks = (0, 0)

    def _load_model(self) -> nn.Module:
        config = self.config
        return load_model(
            config.source, config.model_config, self.backend, self.dtype, self.device, config.load_format,
            config.quantization, self.tp, config.int8_activations,
        )  # fmt: skip

    def _load_draft_model(self) -> nn.Module:
        draft = self.config.draft
        assert draft is not None
        return load_model(draft.source, draft.model_config, self.backend, self.dtype, self.device, "auto", "auto")

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def connect(self, init_method: str) -> None:
        assert self.tp is not None
        self.tp.connect(init_method, self.device)

    def graph_sizes(self) -> list[int]:
        config = self.config
        return decode_graph_sizes(
            self.device,
            self.backend.name,
            enforce_eager=config.enforce_eager,
            max_capture_batch_size=config.max_capture_batch_size,
            max_num_seqs=config.scheduler_config.max_num_seqs,
            tensor_parallel_size=config.parallel_config.tensor_parallel_size,
        )

    def cache_size(self) -> CacheSize:
        """How many blocks this rank's memory holds; with tensor parallelism the minimum
        over ranks (a collective: every rank calls it)."""
        config, budget = self.config, self.config.cache_budget
        bytes_per_block = kv_bytes_per_block(self.model.config, budget.block_size, config.kv_cache_dtype)  # this rank's heads
        if self.draft_model is not None:  # a block holds the draft's K/V of its positions too
            bytes_per_block += kv_bytes_per_block(self.draft_model.config, budget.block_size, config.kv_cache_dtype)
        size = decide_cache_size(
            budget, bytes_per_block, self._memory_facts(),
            config.states_per_seat * self.model.config.state_bytes_per_request(), config.num_state_slots,
        )  # fmt: skip
        self._num_state_slots = size.num_state_slots if config.num_state_slots else 0
        if self.tp is None:
            return size
        num_gpu = self.tp.min_over_ranks(size.num_gpu_blocks)
        num_cpu = self.tp.min_over_ranks(size.num_cpu_blocks)
        how = size.how if num_gpu == size.num_gpu_blocks else f"{size.how}; the smallest over {self.tp.layout.size} ranks"
        return replace(size, num_gpu_blocks=num_gpu, num_cpu_blocks=num_cpu, how=how)

    def _memory_facts(self) -> MemoryFacts:
        """This rank's memory, measured only where the budget depends on it: a GPU's total
        and the peak of a profiling forward, or the RAM free now."""
        budget = self.config.cache_budget
        if budget.num_gpu_blocks_override is not None or budget.kv_cache_memory_bytes is not None:
            return MemoryFacts()
        if self.device.type != "cuda":
            return MemoryFacts(available_ram_bytes=available_ram_bytes())
        from pagellm.worker.profiling import profile_memory

        sizes = self.graph_sizes()
        profile = profile_memory(
            self.model, self.config.scheduler_config, budget.block_size, self.kv_cache_dtype, self.device,
            graph_batch_size=max(sizes) if sizes else None,
        )  # fmt: skip
        properties = torch.cuda.get_device_properties(self.device)
        return MemoryFacts(device_total_bytes=properties.total_memory, used_bytes=profile.total_bytes, device_name=properties.name)

    def init_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self._cache_blocks = (num_gpu_blocks, num_cpu_blocks)  # what wake_up allocates again
        block_size = self.config.cache_budget.block_size
        draft = None
        if self.draft_model is not None:
            draft = DraftModelProposer(self.draft_model, num_gpu_blocks, block_size, self.kv_cache_dtype, self.device)
        self.runner = ModelRunner(
            self.model,
            block_size,
            num_gpu_blocks,
            num_cpu_blocks,
            self.kv_cache_dtype,
            self.device,
            is_driver=self.is_driver,
            grammars=self.grammars,
            draft=draft,
            lora_manager=self.lora_manager,
            kv_tier_store=self._open_kv_tier(),
            kv_tier_host_bytes=self._kv_tier_host_bytes(),
            num_state_slots=self._num_state_slots,
            num_state_snapshots=self._num_state_slots if self.config.num_state_snapshots else 0,
            num_host_state_slots=self.config.host_state_slots(self._num_state_slots),
        )
        sizes = self.graph_sizes()
        if sizes:
            reserved = torch.cuda.memory_reserved(self.device)
            self.runner.capture_decode_graphs(sizes, self.config.max_model_len)
            logger.info("CUDA graphs hold %.2f GiB", (torch.cuda.memory_reserved(self.device) - reserved) / GiB)

    def _open_kv_tier(self) -> TierStore | None:
        """The prefix cache's disk tier, where one is asked for and can serve this model."""
        path = self.config.cache_budget.kv_offload_path
        model_config = self.config.model_config
        if path is None:
            return None
        if not self.config.cache_budget.enable_prefix_caching:
            logger.warning("kv_offload_path is ignored: the tier holds prefix-cache blocks and prefix caching is off")
            return None
        element_bytes = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        store = TierStore(path, TierIdentity.for_engine(self.config, element_bytes))
        logger.info(
            "prefix-cache tier: %s, at most %.2f GiB, %s found",
            store.folder, self.config.cache_budget.kv_offload_bytes / GiB,
            store.describe_entries([size for _, size in store.entries]),
        )  # fmt: skip
        return store

    def _kv_tier_host_bytes(self) -> int:
        host_bytes = self.config.cache_budget.kv_offload_host_bytes
        if host_bytes is None:
            return DEFAULT_KV_OFFLOAD_HOST_BYTES if self.device.type == "cuda" else 0
        return host_bytes

    def execute_model(
        self, scheduler_output: SchedulerOutput, sampled_token_ids: dict[str, list[int]] | None = None
    ) -> ModelRunnerOutput:
        assert self.runner is not None, "init_cache first"
        if sampled_token_ids:
            self.runner.append_sampled(sampled_token_ids)
        return self.runner.execute_model(scheduler_output)

    def sleep(self, level: int) -> None:
        """Free the KV cache (and the runner's states and buffers): level 1; the weights
        too: level 2 (wake_up loads them again from the checkpoint). The disk tier's queued
        writes reach the disk first, so that its prefix cache outlives the sleep."""
        if level >= 2 and self.lora_manager is not None:
            raise InvalidRequestError("level 2 sleep with LoRA adapters is not supported; use level 1", "level")
        self.close_kv_tier()
        self.runner = None
        if level >= 2:
            self.model = None
            self.draft_model = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return_freed_heap()

    def wake_up(self) -> None:
        """Load what sleep freed: the weights (level 2) and the KV cache, as at start."""
        if self.model is None:
            self.model = self._load_model()
            if self.config.draft is not None:
                self.draft_model = self._load_draft_model()
        if self.runner is None:
            self.init_cache(*self._cache_blocks)

    def close_kv_tier(self) -> None:
        """Let the tier's queued writes reach the disk and stop its threads."""
        if self.runner is not None and self.runner.kv_tier is not None:
            self.runner.kv_tier.close()

    def close(self) -> None:
        self.close_kv_tier()
        if self.tp is not None:
            self.tp.close()
        torch.set_num_threads(self._previous_threads)
