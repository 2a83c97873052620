"""The Ray executor: the same TP=2 run as the mp executor, its ranks placed as Ray actors
on a local Ray instance that the test starts (2 CPUs), gives the same tokens."""

import sys

import pytest
from engine_checks import assert_engine_drained
from hf_models import make_tiny_hf_checkpoint
from reference import pagellm_greedy

from pagellm import LLM
from pagellm.errors import ConfigError

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 70))]


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield ray
    ray.shutdown()


def test_ray_executor_gives_the_mp_executor_tokens(tmp_path, local_ray):
    folder = str(make_tiny_hf_checkpoint(tmp_path, seed=9))
    results = {}
    for backend in ("mp", "ray"):
        with LLM(folder, tensor_parallel_size=2, distributed_executor_backend=backend, max_num_batched_tokens=16) as llm:
            results[backend] = pagellm_greedy(llm, PROMPTS, 12)
            assert_engine_drained(llm)
    assert results["ray"] == results["mp"]
    assert len({tuple(t) for t in results["ray"]}) == len(PROMPTS)


def test_without_ray_the_backend_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    folder = str(make_tiny_hf_checkpoint(tmp_path))
    with pytest.raises(ConfigError, match=r"needs Ray: pip install 'pagellm\[ray\]'"):
        LLM(folder, tensor_parallel_size=2, distributed_executor_backend="ray")
