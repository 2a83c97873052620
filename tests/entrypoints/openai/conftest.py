"""Fixtures of the server tests: one tiny model, one shared server, the offline reference.

The main server is shared by the whole directory (starting one costs seconds); tests that
need other flags (admission limit, shutdown) start their own in their module.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from hf_models import make_tiny_hf_checkpoint
from serve_helpers import (
    API_KEY,
    ENGINE_FLAGS,
    MAX_MODEL_LEN,
    ServerProcess,
    engine_cli_flags,
)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("tiny-serve")
    return str(
        make_tiny_hf_checkpoint(folder, "llama", seed=3, max_position_embeddings=MAX_MODEL_LEN)
    )


@pytest.fixture(scope="session")
def model_name(tiny_model: str) -> str:
    """The served name: the model folder's name, as `--served-model-name` defaults to."""
    return Path(tiny_model).name


@pytest.fixture(scope="session")
def server(tiny_model: str) -> Iterator[ServerProcess]:
    process = ServerProcess(["--model", tiny_model, *engine_cli_flags()], api_key=API_KEY)
    yield process
    status = process.stop(signal.SIGINT)
    assert status == 0, process.log


@pytest.fixture(scope="session")
def single_torch_thread() -> Iterator[None]:
    """One torch thread in this process while servers run beside it (see ServerProcess);
    the previous setting comes back at the end."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def offline_llm(tiny_model: str, single_torch_thread: None):  # noqa: ANN201 - pagellm.LLM
    """The offline API on the same model and settings: what the server must agree with."""
    from pagellm import LLM

    return LLM(tiny_model, **ENGINE_FLAGS)


@pytest.fixture
def client(server: ServerProcess):  # noqa: ANN201 - openai.OpenAI
    import openai

    with openai.OpenAI(
        base_url=server.api_url, api_key=API_KEY, max_retries=0, timeout=120
    ) as c:
        yield c


@pytest.fixture(scope="session")
def smol_server(smollm2_path) -> Iterator[ServerProcess]:
    """The embedded SmolLM2 behind the server (structured outputs and tools need a real
    tokenizer and a model that writes sensible JSON)."""
    process = ServerProcess(["--model", str(smollm2_path), "--served-model-name", "smol", "--max-model-len", "1024"])
    yield process
    assert process.stop(signal.SIGINT) == 0, process.log


@pytest.fixture
def smol(smol_server: ServerProcess):  # noqa: ANN201 - openai.OpenAI
    import openai

    with openai.OpenAI(base_url=smol_server.api_url, api_key="none", max_retries=0, timeout=120) as c:
        yield c
