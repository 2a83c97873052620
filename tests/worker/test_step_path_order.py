"""How a step runs (worker/step_paths/): the first path that applies runs it; the native
paths exist for the models whose layers they compute, and adapters keep a step off the
one-call layer."""

from __future__ import annotations

import pytest
import torch
from hf_models import make_tiny_hf_checkpoint

from pagellm.attention.selector import get_attention_backend
from pagellm.model.loader import ModelSource, load_model, load_model_config
from pagellm.model.native.llama_layer import computes_llama_layers
from pagellm.worker.kv_cache import allocate_kv_caches
from pagellm.worker.model_inputs import ScheduledSequence
from pagellm.worker.step_paths import StepInputs, StepPaths
from pagellm.worker.step_paths.base import EagerPath


class FakePath:
    def __init__(self, name: str, takes: bool, log: list[str]) -> None:
        self.name, self.takes, self.log = name, takes, log

    def applies(self, step: StepInputs) -> bool:
        self.log.append(f"{self.name}?")
        return self.takes

    def run(self, step: StepInputs) -> torch.Tensor:
        self.log.append(self.name)
        return torch.full((step.num_tokens, 2), float(len(self.name)))


class FakeEager(EagerPath):
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def run(self, step: StepInputs) -> torch.Tensor:
        self.log.append("eager")
        return torch.zeros(step.num_tokens, 2)


def step_of(*lengths: int, adapters: bool = False) -> StepInputs:
    sequences = [ScheduledSequence(list(range(n)), 0, [[1]], True) for n in lengths]
    return StepInputs(sequences, [], 16, "cpu", has_adapters=adapters)


def test_the_first_path_that_applies_runs_the_step():
    log: list[str] = []
    paths = StepPaths([FakePath("a", False, log), FakePath("bb", True, log), FakePath("c", True, log), FakeEager(log)])
    step = step_of(3, 1)
    assert step.query_starts == [0, 3, 4] and step.num_tokens == 4
    assert paths.forward(step).tolist() == [[2.0, 2.0]] * 4
    assert log == ["a?", "bb?", "bb"]  # c never asked
    log.clear()
    assert paths.without("bb").forward(step).tolist() == [[1.0, 1.0]] * 4
    assert log == ["a?", "c?", "c"]
    log.clear()
    assert paths.without("a", "bb", "c").names == ["eager"]
    paths.without("a", "bb", "c").forward(step)
    assert log == ["eager"]
    with pytest.raises(AssertionError):
        StepPaths([FakePath("a", True, log)])  # nothing would run what it leaves


FAMILIES = {"llama": True, "qwen2": True, "qwen3": True, "qwen3_moe": True, "gemma2": False, "gemma3": False}


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_the_native_paths_compute_the_llama_layer_only(tmp_path, arch):
    extra = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32} if arch == "qwen3_moe" else {}
    folder = make_tiny_hf_checkpoint(tmp_path, arch, **extra)
    source = ModelSource("hf", folder, "tiny")
    model = load_model(source, load_model_config(source), get_attention_backend(), torch.float32)
    assert computes_llama_layers(model) is FAMILIES[arch]
    # float32: no CPU kernels were attached at load, so only the model's own forward.
    assert StepPaths.for_model(model).names == ["eager"]


def test_bf16_paths_and_adapters(tmp_path):
    from default_path import native_bf16_kernels_available

    if not native_bf16_kernels_available():
        pytest.skip("needs the native CPU kernels (x86-64 with AVX2, and a C compiler)")
    folders = {arch: make_tiny_hf_checkpoint(tmp_path / arch, arch) for arch in ("llama", "gemma3")}
    models = {
        arch: load_model(ModelSource("hf", f, arch), load_model_config(ModelSource("hf", f, arch)),
                         get_attention_backend(), torch.bfloat16)
        for arch, f in folders.items()
    }  # fmt: skip
    assert StepPaths.for_model(models["gemma3"]).names == ["eager"]  # sandwich norms, (1 + w): not native
    paths = StepPaths.for_model(models["llama"])
    assert paths.names == ["measured", "fused", "layers", "eager"]
    kv = allocate_kv_caches(models["llama"].config, 4, 16, torch.bfloat16, "cpu")
    decode = [ScheduledSequence([5], 3, [[1]], True), ScheduledSequence([6], 7, [[2]], True)]
    assert paths.get("fused").applies(StepInputs(decode, kv, 16, "cpu"))
    with_adapters = StepInputs(decode, kv, 16, "cpu", has_adapters=True)
    # The one-call layer runs the linears in C without the adapters' products: not taken.
    assert not paths.get("fused").applies(with_adapters) and not paths.get("measured").applies(with_adapters)
    assert paths.get("layers").applies(with_adapters)
