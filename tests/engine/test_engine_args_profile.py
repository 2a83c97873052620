"""--profile fills the prefill/decode knobs the user left unset."""

import pytest

from pagellm.config.engine_args import PROFILES, EngineArgs
from pagellm.errors import ConfigError


def test_profiles_fill_only_unset_knobs():
    offline = EngineArgs(profile="offline").with_profile()
    assert offline.max_num_batched_tokens == 8192 and offline.prefill_share == 1.0
    interactive = EngineArgs(profile="interactive", prefill_share=0.5).with_profile()
    assert interactive.prefill_share == 0.5  # explicit wins
    assert interactive.max_num_partial_prefills == PROFILES["interactive"]["max_num_partial_prefills"]
    assert EngineArgs().with_profile() == EngineArgs()


def test_bad_profile_and_profile_without_chunking():
    with pytest.raises(ConfigError, match="profile must be one of"):
        EngineArgs(profile="fast")
    with pytest.raises(ConfigError, match="needs enable_chunked_prefill"):
        EngineArgs(profile="offline", enable_chunked_prefill=False)
