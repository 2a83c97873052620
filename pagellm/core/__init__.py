"""Core stage: the continuous-batching scheduler and the paged KV cache bookkeeping.

Pure Python, no torch import, so that the policy is unit-testable in milliseconds.
"""

from pagellm.core.block_pool import BlockPool, KVBlock
from pagellm.core.kv_cache_manager import NO_HIT, ComputedBlocks, KVCacheManager, KVCacheStats
from pagellm.core.scheduler import Scheduler, SchedulerStats
from pagellm.core.scheduler_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    RequestProgress,
    SchedulerOutput,
)

__all__ = [
    "BlockPool",
    "CachedRequestData",
    "ComputedBlocks",
    "NO_HIT",
    "KVBlock",
    "KVCacheManager",
    "KVCacheStats",
    "ModelRunnerOutput",
    "NewRequestData",
    "RequestProgress",
    "Scheduler",
    "SchedulerOutput",
    "SchedulerStats",
]
