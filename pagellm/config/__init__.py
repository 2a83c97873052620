"""Config stage: where every setting is decided, without torch.

- engine_args.py / cli_args.py: what users set (EngineArgs, the flags);
- model.py: which checkpoint runs and its shapes (ModelSource, ModelConfig);
- scheduler.py, cache.py, parallel.py, speculative.py: each stage's settings and rules;
- engine_config.py: `resolve_engine_config`, the one resolver, and EngineConfig, what
  the executor, the workers and the scheduler are built from.

The names below are the ones most stages import.
"""

from pagellm.config.cache import CacheConfig
from pagellm.config.engine_args import EngineArgs
from pagellm.config.engine_config import DeviceFacts, EngineConfig, resolve_engine_config
from pagellm.config.model import ModelConfig, ModelSource
from pagellm.config.scheduler import SchedulerConfig
from pagellm.config.speculative import SpeculativeConfig
from pagellm.errors import ConfigError

__all__ = [
    "CacheConfig",
    "ConfigError",
    "DeviceFacts",
    "EngineArgs",
    "EngineConfig",
    "ModelConfig",
    "ModelSource",
    "SchedulerConfig",
    "SpeculativeConfig",
    "resolve_engine_config",
]
