"""Config stage: the paged KV cache's shape, and how many blocks a memory budget holds.

The block count is the one setting that needs a measurement first (the device's memory,
what the loaded model and a profiling forward use, the RAM free now). Each rank measures
them into `MemoryFacts`; `decide_cache_size` turns facts and the user's budget settings
into blocks, the same function whether the facts were measured by a worker or estimated
by the simulator from a GPU preset.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagellm.config.kv_layout import kv_cache_layout
from pagellm.config.model import ModelConfig
from pagellm.config.units import GiB, cdiv
from pagellm.config.validation import check_int
from pagellm.errors import ConfigError

# auto: the KV cache in the model's dtype; fp8_*: 8-bit floats (torch.float8_e4m3fn,
# torch.float8_e5m2), half the bytes of bf16, per-tensor scale 1.0, saturated on store.
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8_e4m3", "fp8_e5m2")
# Bytes per element of every dtype a model or its KV cache may be resolved to.
DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}
# A hybrid model's recurrent state is kept after every this many full blocks (64 tokens of
# 16) for prefix hits to resume from: see benchmarks/results for the measurement behind it.
DEFAULT_STATE_SNAPSHOT_INTERVAL = 4
# On CPU the "device" memory is the machine's RAM, shared with everything else: the KV
# cache gets a fixed budget (like vLLM's CPU backend) rather than a fraction of all RAM.
DEFAULT_CPU_KV_CACHE_BYTES = 4 * GiB


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """Shape of the paged KV cache.

    num_gpu_blocks counts every device block including block 0, which the block pool
    reserves as a null block; the usable capacity is (num_gpu_blocks - 1) * block_size
    tokens of each KV cache group. num_cpu_blocks is the host pool used when requests are
    swapped out (0 = swapping impossible; swap preemption then falls back to recompute).
    group_windows: the sliding window of each KV cache group (config/kv_layout.py); one
    global group for most models.
    """

    block_size: int = 16
    num_gpu_blocks: int
    num_cpu_blocks: int = 0
    enable_prefix_caching: bool = True
    group_windows: tuple[int | None, ...] = (None,)
    # The prefix cache's second tier (core/kv_tier.py): its size bound in bytes (0: no
    # tier) and how many block writes may wait in its queue before new ones are dropped.
    kv_offload_bytes: int = 0
    kv_offload_max_pending_writes: int = 256
    # A hybrid model's recurrent-state slots (one per running request; 0: not a hybrid), and
    # the snapshots of that state kept for prefix hits, one after every
    # state_snapshot_interval full blocks (core/state_snapshots.py).
    num_state_slots: int = 0
    num_state_snapshots: int = 0
    state_snapshot_interval: int = DEFAULT_STATE_SNAPSHOT_INTERVAL
    # Host slots for the state of requests swapped out (swap preemption; 0: none, a
    # hybrid's preempted requests are recomputed).
    num_host_state_slots: int = 0

    def __post_init__(self) -> None:
        check_int("CacheConfig", "block_size", self.block_size, 1)
        check_int("CacheConfig", "num_state_slots", self.num_state_slots, 0)
        check_int("CacheConfig", "num_host_state_slots", self.num_host_state_slots, 0)
        check_int("CacheConfig", "num_state_snapshots", self.num_state_snapshots, 0)
        check_int("CacheConfig", "state_snapshot_interval", self.state_snapshot_interval, 1)
        # Block 0 is the null block, so one more is needed to hold any token at all.
        check_int("CacheConfig", "num_gpu_blocks", self.num_gpu_blocks, 2)
        check_int("CacheConfig", "num_cpu_blocks", self.num_cpu_blocks, 0)
        check_int("CacheConfig", "kv_offload_bytes", self.kv_offload_bytes, 0)
        check_int("CacheConfig", "kv_offload_max_pending_writes", self.kv_offload_max_pending_writes, 1)
        if not self.group_windows or any(w is not None and w < 1 for w in self.group_windows):
            raise ConfigError(f"CacheConfig.group_windows must list a window (or None) per group, got {self.group_windows!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ConfigError(
                "CacheConfig.enable_prefix_caching must be a bool, "
                f"got {self.enable_prefix_caching!r}."
            )

    @property
    def num_usable_gpu_blocks(self) -> int:
        """Device blocks that can hold tokens (all but the null block)."""
        return self.num_gpu_blocks - 1

    @property
    def max_num_cached_tokens(self) -> int:
        """Most tokens the device cache can hold at once in every group (sliding groups
        hold only their windows, so a sliding-window model holds more)."""
        return self.num_usable_gpu_blocks * self.block_size // len(self.group_windows)

    def max_blocks_per_request(self, num_tokens: int, max_step_tokens: int) -> int:
        """Most device blocks a request of `num_tokens` holds at once when a step computes
        at most `max_step_tokens` of it: a global group one per block_size tokens, a
        sliding group those of one window plus one step's tokens (the KV cache manager
        frees the older ones before each step's allocation)."""
        num_blocks = cdiv(num_tokens, self.block_size)
        total = 0
        for window in self.group_windows:
            if window is None:
                total += num_blocks
            else:
                total += min(num_blocks, cdiv(window - 1 + max_step_tokens, self.block_size) + 1)
        return total


@dataclass(frozen=True, kw_only=True)
class CacheBudget:
    """The user's settings that size the cache, in order of precedence:
    num_gpu_blocks_override, kv_cache_memory_bytes, then the device's budget
    (gpu_memory_utilization of a GPU's memory; a fixed default on CPU)."""

    block_size: int = 16
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    swap_space_bytes: int = 0  # host memory for swapped-out blocks (swap preemption only)
    # The prefix cache's second tier on local disk (None: none) and its size bound.
    kv_offload_path: str | None = None
    kv_offload_bytes: int = 0
    kv_offload_host_bytes: int | None = None  # its host-memory cache (None: the device's default)
    state_snapshot_interval: int = DEFAULT_STATE_SNAPSHOT_INTERVAL  # a hybrid's, in blocks


@dataclass(frozen=True)
class MemoryFacts:
    """What one rank measured (or the simulator estimated) about its memory."""

    device_total_bytes: int | None = None  # a GPU's memory; None on CPU
    used_bytes: int = 0  # GPU: peak use besides the KV cache (weights, activations, ...)
    used_how: str = "peak use (weights + activations)"  # what used_bytes counts, for the log
    available_ram_bytes: int | None = None  # CPU: RAM free now (the budget takes half at most); None: no cap
    device_name: str | None = None  # for messages ("no memory left ... on H100")


@dataclass(frozen=True)
class CacheSize:
    num_gpu_blocks: int  # including the reserved null block 0
    num_cpu_blocks: int
    kv_cache_bytes: int
    how: str  # how the size was decided, for the start-up log
    num_state_slots: int = 0  # a hybrid's recurrent-state slots (seats), each with its snapshot


# The most of the cache budget a hybrid's recurrent states (a slot and a snapshot per seat)
# may take before the seats are cut: the rest holds the attending layers' KV. A 1B-class
# hybrid's state is ~20 MiB per request, so 256 seats' worth would exceed the CPU's
# default budget on their own.
MAX_STATE_SHARE = 0.5


def kv_bytes_per_block(config: ModelConfig, block_size: int, kv_cache_dtype: str) -> int:
    """Bytes one block takes (K and V) across the layers of one KV cache group of `config`
    (config/kv_layout.py: all layers for most models), with one rank's heads under tensor
    parallelism, in the cache's dtype (fp8: one byte per element)."""
    layout = kv_cache_layout(config)
    per_token = 2 * layout.tensor_width * DTYPE_BYTES[kv_cache_dtype]
    return layout.layers_per_block * block_size * per_token


def decide_cache_size(
    budget: CacheBudget, bytes_per_block: int, memory: MemoryFacts, state_bytes_per_seat: int = 0, max_seats: int = 0
) -> CacheSize:
    """Device and host blocks for `budget` on a rank whose blocks take `bytes_per_block`,
    after a hybrid model's recurrent states (`state_bytes_per_seat` for each of up to
    `max_seats` running requests) took their part: all the seats where they fit in
    MAX_STATE_SHARE of the budget, else as many as do (at least one)."""
    seats = max_seats
    num_cpu_blocks = budget.swap_space_bytes // bytes_per_block
    if budget.num_gpu_blocks_override is not None:
        num = budget.num_gpu_blocks_override
        how = "num_gpu_blocks_override"
    else:
        if budget.kv_cache_memory_bytes is not None:
            size, how = budget.kv_cache_memory_bytes, "kv_cache_memory_bytes"
        elif memory.device_total_bytes is not None:
            total, used, fraction = memory.device_total_bytes, memory.used_bytes, budget.gpu_memory_utilization
            size = int(total * fraction) - used
            how = f"gpu_memory_utilization={fraction} of {total / GiB:.4g} GiB minus {used / GiB:.2f} GiB {memory.used_how}"
            if size <= 0:
                where = f" on {memory.device_name}" if memory.device_name else ""
                raise ConfigError(
                    f"no memory left for the KV cache{where}: {memory.used_how} take {used / GiB:.2f} GiB, "
                    f"more than gpu_memory_utilization={fraction} of {total / GiB:.4g} GiB; raise "
                    "gpu_memory_utilization or lower max_num_batched_tokens"
                )
        else:
            size = DEFAULT_CPU_KV_CACHE_BYTES
            if memory.available_ram_bytes is not None:
                size = min(size, memory.available_ram_bytes // 2)
            how = f"CPU default budget ({size / GiB:.2f} GiB)"
        if state_bytes_per_seat and max_seats:
            seats = min(max_seats, int(MAX_STATE_SHARE * size) // state_bytes_per_seat)
            if seats < 1:
                raise ConfigError(
                    f"the KV cache budget ({how}) cannot hold one request's recurrent state "
                    f"({state_bytes_per_seat / GiB:.3g} GiB) in {MAX_STATE_SHARE:.0%} of it"
                )
            how += f", less {seats * state_bytes_per_seat / GiB:.3g} GiB of recurrent states for {seats} requests"
            if seats < max_seats:
                how += f" (not {max_seats}: more would take over {MAX_STATE_SHARE:.0%} of the budget)"
        # +1: block 0 is the reserved null block and holds no tokens.
        num = max(size - seats * state_bytes_per_seat, 0) // bytes_per_block + 1
    if num < 2:
        raise ConfigError(f"the KV cache budget ({how}) is smaller than one block of {bytes_per_block} bytes")
    return CacheSize(num, num_cpu_blocks, (num - 1) * bytes_per_block, how, seats if state_bytes_per_seat else 0)


def sized_cache_config(
    budget: CacheBudget,
    size: CacheSize,
    max_model_len: int,
    group_windows: tuple[int | None, ...] = (None,),
    max_step_tokens: int | None = None,
    num_state_slots: int = 0,
    num_state_snapshots: int = 0,
    num_host_state_slots: int = 0,
) -> CacheConfig:
    """The cache the scheduler gets (KV cache groups with `group_windows`); one too small
    for a request of max_model_len (steps of at most max_step_tokens; None: one step) is
    an error that names the largest max_model_len it holds."""
    cache_config = CacheConfig(
        block_size=budget.block_size,
        num_gpu_blocks=size.num_gpu_blocks,
        num_cpu_blocks=size.num_cpu_blocks,
        enable_prefix_caching=budget.enable_prefix_caching,
        group_windows=group_windows,
        kv_offload_bytes=budget.kv_offload_bytes if budget.kv_offload_path else 0,
        num_state_slots=num_state_slots,
        num_state_snapshots=num_state_snapshots,
        state_snapshot_interval=budget.state_snapshot_interval,
        num_host_state_slots=num_host_state_slots,
    )
    step = max_model_len if max_step_tokens is None else max_step_tokens
    if cache_config.max_blocks_per_request(max_model_len, step) > cache_config.num_usable_gpu_blocks:
        capacity = longest_request_tokens(cache_config, step, max_model_len)
        raise ConfigError(
            f"the KV cache ({size.how}) holds {capacity} tokens, too few for one request "
            f"of max_model_len={max_model_len}; the largest max_model_len that fits is "
            f"{capacity}. Lower max_model_len or give the cache more memory."
        )
    return cache_config


def longest_request_tokens(cache_config: CacheConfig, max_step_tokens: int, limit: int) -> int:
    """The most tokens (up to `limit`) one request's KV can reach in the cache, steps of
    at most max_step_tokens (binary search: the blocks a request holds grow with its
    length; in sliding groups they stop growing at the window)."""

    def fits(num_tokens: int) -> bool:
        blocks = cache_config.max_blocks_per_request(num_tokens, min(num_tokens, max_step_tokens))
        return blocks <= cache_config.num_usable_gpu_blocks

    low, high = 0, limit
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low
