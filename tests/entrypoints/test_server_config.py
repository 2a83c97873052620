"""`pagellm serve`'s settings as one ServerConfig (entrypoints/openai/server_config.py): parsed
from the flags, checked once with the errors the flags name, and carried to a data-parallel
replica's command line and back."""

from __future__ import annotations

import argparse

import pytest

from pagellm.config.cli_args import engine_args_from_namespace
from pagellm.entrypoints.cli import build_parser
from pagellm.entrypoints.openai.limits_config import RequestLimits
from pagellm.entrypoints.openai.server_config import ServerConfig
from pagellm.errors import ConfigError


def parse(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *flags])


def test_flags_become_typed_settings():
    args = parse(
        "--port", "9001", "--served-model-name", "m", "--max-num-queued-requests", "7", "--shutdown-timeout", "2.5",
        "--reasoning-parser", "deepseek_r1", "--structured-outputs-config", '{"enable_in_reasoning": true}',
        "--batch-dir", "none", "--lora-modules", "a=/x", "b=/y", "--max-n", "4",
    )  # fmt: skip
    config = ServerConfig.from_namespace(args, environ={})
    assert (config.port, config.served_model_name, config.max_num_queued_requests, config.shutdown_timeout) == (9001, "m", 7, 2.5)
    assert config.reasoning_parser == "deepseek_r1" and config.structured_outputs_in_reasoning
    assert config.lora_modules == ("a=/x", "b=/y") and config.batch_dir == "none"
    assert config.limits == RequestLimits(max_n=4)
    assert ServerConfig.from_namespace(parse(), environ={}) == ServerConfig()


def test_the_api_key_comes_from_the_environment_where_no_flag_gives_one():
    assert ServerConfig.from_namespace(parse(), environ={"PAGELLM_API_KEY": "k"}).api_key == "k"
    assert ServerConfig.from_namespace(parse("--api-key", "f"), environ={"PAGELLM_API_KEY": "k"}).api_key == "f"
    assert ServerConfig.from_namespace(parse(), environ={"PAGELLM_API_KEY": ""}).api_key is None


@pytest.mark.parametrize(
    "flags,message",
    [
        (("--port", "70000"), "--port must be in [0, 65535], got 70000"),
        (("--shutdown-timeout", "-1"), "--shutdown-timeout must be >= 0, got -1.0"),
        (("--max-num-queued-requests", "0"), "--max-num-queued-requests must be at least 1, got 0"),
        (("--data-parallel-size", "0"), "--data-parallel-size must be at least 1, got 0"),
        (("--max-n", "0"), "--max-n must be at least 1, got 0"),
    ],
)
def test_a_bad_setting_is_named(flags, message):
    with pytest.raises(ConfigError) as error:
        ServerConfig.from_namespace(parse(*flags), environ={})
    assert str(error.value) == message


def test_what_the_settings_need_of_the_engine():
    with pytest.raises(ConfigError, match="--lora-modules needs --enable-lora"):
        ServerConfig(lora_modules=("a=/x",)).check_engine(enable_lora=False)
    with pytest.raises(ConfigError, match="--enable-lora with --data-parallel-size > 1 is not supported yet"):
        ServerConfig(data_parallel_size=2).check_engine(enable_lora=True)
    ServerConfig(lora_modules=("a=/x",)).check_engine(enable_lora=True)


def test_a_replica_gets_the_same_request_handling():
    args = parse(
        "--data-parallel-size", "2", "--reasoning-parser", "deepseek_r1", "--max-num-queued-requests", "5",
        "--structured-outputs-config", '{"enable_in_reasoning": true}', "--max-n", "3", "--shutdown-timeout", "9",
        "--max-model-len", "256",
    )  # fmt: skip
    config = ServerConfig.from_namespace(args, environ={})
    replica = config.replica("served")
    flags = replica.to_cli()
    back = ServerConfig.from_namespace(parse(*flags), environ={})
    assert back == replica and back.served_model_name == "served" and back.batch_dir == "none"
    assert back.limits.max_n == 3 and back.structured_outputs_in_reasoning and back.max_num_queued_requests == 5
    assert engine_args_from_namespace(args).max_model_len == 256
