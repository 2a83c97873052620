"""Engine arguments for running on a GPU, checked where they can be on CPU: random
(dummy) weights, the attention backend choice, and when decode graphs are captured."""

from __future__ import annotations

import shutil

import pytest
import torch
from hf_models import make_tiny_hf_checkpoint

from pagellm import LLM, SamplingParams
from pagellm.attention.torch_backend import TorchAttentionBackend
from pagellm.config.engine_args import EngineArgs
from pagellm.worker.worker import decode_graph_sizes
from pagellm.errors import ConfigError
from pagellm.worker.profiling import MemoryProfile


def test_dummy_weights_need_only_the_config(tmp_path):
    full = make_tiny_hf_checkpoint(tmp_path / "full", "llama")
    shapes_only = tmp_path / "shapes"
    shapes_only.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (full / name).exists():
            shutil.copy(full / name, shapes_only / name)
    assert not list(shapes_only.glob("*.safetensors"))
    llm = LLM(str(shapes_only), load_format="dummy", max_model_len=64)
    params = dict(llm.engine.runner.model.named_parameters())
    assert torch.equal(params["norm.weight"], torch.ones_like(params["norm.weight"]))
    weight = params["layers.0.mlp.down_proj.weight"]
    assert 0.01 < float(weight.detach().std()) < 0.03 and torch.isfinite(weight).all()
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6
    # Without load_format=dummy the missing weights are an error that says so.
    with pytest.raises(Exception, match=r"safetensors|weights"):
        LLM(str(shapes_only), max_model_len=64)


def test_bad_device_arguments_are_named():
    with pytest.raises(ConfigError, match="load_format"):
        EngineArgs(load_format="pt")
    with pytest.raises(ConfigError, match="attention_backend"):
        EngineArgs(attention_backend="flash")
    with pytest.raises(ConfigError, match="max_capture_batch_size"):
        EngineArgs(max_capture_batch_size=0)


def test_graph_sizes_only_for_triton_on_cuda():
    cuda = torch.device("cuda")

    def sizes(device=cuda, backend="triton", enforce_eager=False, max_capture_batch_size=None, max_num_seqs=256, tp=1):
        return decode_graph_sizes(
            device, backend, enforce_eager=enforce_eager, max_capture_batch_size=max_capture_batch_size,
            max_num_seqs=max_num_seqs, tensor_parallel_size=tp,
        )  # fmt: skip

    assert sizes(device=torch.device("cpu")) == []
    assert sizes(enforce_eager=True) == []
    assert sizes(backend=TorchAttentionBackend().name) == []
    assert sizes(tp=2) == []  # collectives are not captured
    assert sizes(max_num_seqs=100)[0] == 1 and sizes(max_num_seqs=100)[-1] == 100
    assert sizes(max_capture_batch_size=8)[-1] == 8
    assert sizes(max_num_seqs=2048)[-1] == 512


def test_memory_profile_adds_up():
    GiB = 1 << 30
    profile = MemoryProfile(16 * GiB, 3 * GiB, GiB, GiB // 2)
    assert profile.total_bytes == int(20.5 * GiB)
    assert "weights 16.00 GiB" in profile.describe() and "CUDA graphs 1.00 GiB" in profile.describe()


def test_cli_has_the_device_flags():
    import argparse

    from pagellm.config.cli_args import add_engine_args, engine_args_from_namespace

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(
        ["--load-format", "dummy", "--attention-backend", "triton", "--enforce-eager", "--max-capture-batch-size", "64"]
    )
    args = engine_args_from_namespace(ns)
    assert (args.load_format, args.attention_backend, args.enforce_eager, args.max_capture_batch_size) == (
        "dummy", "triton", True, 64,
    )
    with pytest.raises(SystemExit):
        parser.parse_args(["--attention-backend", "flash"])


def test_a_single_rank_takes_the_current_cuda_device(monkeypatch):
    # torch.cuda.set_device refuses a bare "cuda" (torch 2.11 on an H200: every engine
    # start failed there); the worker names the index before it calls it.
    from pagellm.worker.worker import with_device_index

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert with_device_index(torch.device("cuda")) == torch.device("cuda", 3)
    assert with_device_index(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert with_device_index(torch.device("cpu")) == torch.device("cpu")
