"""The CPU bf16 linear kernels (weights streamed once for up to 16 rows, repacked into
register tiles above) against a float64 reference, in every kernel build the host executes,
and their routing inside the model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagellm.kernels.decode_layer import MAX_ROWS
from pagellm.kernels.linear_bindings import cpu_linear_kernels
from pagellm.kernels.linear_choice import NUM_BUCKETS, LinearPlan
from pagellm.model.packable_layers import PackableLinear, apply_linear

kernel = cpu_linear_kernels()


def linear(x, weight, bias, kernel, impl=None, out_dtype=None):  # noqa: ANN001, ANN201
    plan = None if impl is None else LinearPlan((impl,) * NUM_BUCKETS)
    return apply_linear(x, weight, None, bias, kernel, plan, out_dtype)
needs_kernel = pytest.mark.skipif(kernel is None, reason="needs x86-64 with AVX2 and a C compiler")


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected).norm() / expected.norm())


@needs_kernel
# Streaming (up to 16 rows): every row count; tiles: 6-row tiles with every remainder,
# blocks of 192 rows.
@pytest.mark.parametrize("m", [*range(1, 25), 37, 64, 200, 389])
# Panels of 64 columns with 1-3 vector remainders and a ragged last vector; K: 16-pair
# packing steps with remainders, odd K (a half pair).
@pytest.mark.parametrize("n,k,with_bias", [(1536, 576, False), (7, 70, True), (577, 1536, True), (1, 31, False),
                                           (100, 33, True), (49, 1, False)])
def test_matches_float64_reference(m, n, k, with_bias):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen).bfloat16()
    weight = torch.randn(n, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16() if with_bias else None
    expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    with torch.inference_mode():
        actual = linear(x, weight, bias, kernel)
    assert actual.dtype == torch.bfloat16 and actual.shape == (m, n)
    # float32 accumulation, one bf16 rounding of the result (relative 2^-9 at worst).
    assert _relative_error(actual, expected) < 4e-3


BUCKET_EDGE_ROWS = [1, 2, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65, 256, 257]


@pytest.mark.parametrize("impl", ["streaming", "gemm", "amx"])
def test_every_isa_build_matches_float64_reference(kernel_isa, impl):
    # Each build (AVX2 float32 arithmetic, AVX-512 BF16 dot products, AMX tiles) and each of
    # its kernels, at every bucket edge, over shapes with ragged panels and odd K.
    from pagellm.kernels.linear_bindings import LinearImpl

    build_kernel = cpu_linear_kernels()
    gen = torch.Generator().manual_seed(5)
    for n, k, with_bias in [(577, 576, True), (7, 70, False), (49, 1, True), (100, 33, False)]:
        weight = torch.randn(n, k, generator=gen).bfloat16()
        bias = torch.randn(n, generator=gen).bfloat16() if with_bias else None
        for m in BUCKET_EDGE_ROWS:
            x = torch.randn(m, k, generator=gen).bfloat16()
            expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
            for out_dtype in (torch.bfloat16, torch.float32):
                with torch.inference_mode():
                    actual = linear(x, weight, bias, build_kernel, LinearImpl[impl.upper()], out_dtype)
                assert actual.dtype == out_dtype and actual.shape == (m, n)
                assert _relative_error(actual, expected) < 4e-3, (kernel_isa, impl, n, k, m, out_dtype)


@needs_kernel
@pytest.mark.parametrize("m", [1, 3, 30])
def test_nan_and_infinity_propagate_to_their_rows_only(m):
    # A diverged activation row must come out NaN or infinite, never silently finite,
    # and must not touch the other rows.
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(m, 64, generator=gen).bfloat16()
    weight = torch.randn(48, 64, generator=gen).bfloat16()
    x[0, 3] = float("nan")
    if m > 1:
        x[1, 5] = float("inf")
    with torch.inference_mode():
        out = linear(x, weight, None, kernel)
    assert bool(out[0].isnan().all())
    if m > 1:
        assert not bool(out[1].isfinite().any())
        assert bool(out[2].isfinite().all())


@needs_kernel
def test_strided_rows_and_fallbacks(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(64, 96, generator=gen).bfloat16()
    for rows in (3, 40):  # streaming, tiles
        x = torch.randn(rows, 200, generator=gen).bfloat16()[:, :96]  # rows 200 elements apart
        with torch.inference_mode():
            got = linear(x, weight, None, kernel).float()
        torch.testing.assert_close(got, F.linear(x, weight).float(), rtol=2e-2, atol=2e-2)
    calls = []
    monkeypatch.setattr(type(kernel), "__call__", lambda self, *a: calls.append(a))
    with torch.inference_mode():
        linear(torch.randn(2, 96), weight.float(), None, kernel)  # float32
    linear(torch.randn(2, 96).bfloat16(), weight, None, kernel)  # autograd on: torch
    assert calls == []


@needs_kernel
def test_model_layers_route_through_the_kernel(monkeypatch):
    layer = PackableLinear(32, 16, bias=True).bfloat16()
    layer.kernel = kernel
    seen = []
    original = type(kernel).__call__

    def spy(self, x, weight, bias, impl, out_dtype):
        seen.append(x.shape[0])
        return original(self, x, weight, bias, impl, out_dtype)

    monkeypatch.setattr(type(kernel), "__call__", spy)
    with torch.inference_mode():
        out = layer(torch.randn(4, 32).bfloat16())
        layer(torch.randn(20, 32).bfloat16())
        layer.float()(torch.randn(4, 32))  # float32: torch
    assert seen == [4, 20]
    assert out.shape == (4, 16)


@needs_kernel
@pytest.mark.parametrize("arch,num_requests", [("llama", 3), ("qwen2", 3), ("llama", 19), ("llama", 40)])  # qwen2: biases
def test_bf16_model_logits_native_and_torch(tmp_path, arch, num_requests, monkeypatch):
    # The routing asserted below needs native linears at every row count (the measured
    # choice may put some on oneDNN, which the one-call layer cannot call).
    monkeypatch.setenv("PAGELLM_LINEAR_KERNEL", "streaming")
    from hf_models import make_tiny_hf_checkpoint

    from pagellm.attention.selector import get_attention_backend
    from pagellm.model.loader import ModelSource, load_model, load_model_config
    from pagellm.model.native.after_load import set_linear_kernels
    from pagellm.worker.kv_cache import allocate_kv_caches
    from pagellm.worker.model_inputs import ScheduledSequence
    from pagellm.worker.step_paths import StepInputs, StepPaths

    folder = make_tiny_hf_checkpoint(tmp_path, arch, hidden_size=128, intermediate_size=256)
    source = ModelSource("hf", folder, "tiny")
    float32_model = load_model(source, load_model_config(source), get_attention_backend(), torch.float32)
    with torch.no_grad():  # the same (bf16) weights, computed in float32: the paths' own error
        for param in float32_model.parameters():
            param.copy_(param.bfloat16().float())
    model = load_model(source, load_model_config(source), get_attention_backend(), torch.bfloat16)
    assert model.cpu_linear_kernels is not None  # bf16 on CPU: attached at load
    paths = StepPaths.for_model(model)  # as the runner runs a step
    assert paths.get("fused") is not None and paths.get("layers") is not None

    def prefill_and_decode_logits(model=model, paths=paths) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # noqa: ANN001
        # A prefill step, one decode step (one row per request), then a step of 4 rows per
        # request crossing a block boundary (a speculative verification: 12 rows for 3
        # requests take the one-call layer, each row attending up to its own position).
        dtype = next(model.parameters()).dtype
        kv = allocate_kv_caches(model.config, 2 * num_requests + 1, 16, dtype, "cpu")
        shapes = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [20] * 12, [30, 31, 32, 33, 34, 35, 36, 37]]
        prompts = [[t + i for t in shapes[i % 3]] for i in range(num_requests)]
        tables = [[i + 1, num_requests + i + 1] for i in range(num_requests)]
        def forward(sequences: list[ScheduledSequence]) -> torch.Tensor:
            return paths.forward(StepInputs(sequences, kv, 16, "cpu"))

        with torch.inference_mode():
            prefill = [ScheduledSequence(p, 0, [t], True) for p, t in zip(prompts, tables)]
            prefill_logits = model.compute_logits(forward(prefill))
            decode = [ScheduledSequence([40 + i], len(p), [t], True) for i, (p, t) in enumerate(zip(prompts, tables))]
            decode_logits = model.compute_logits(forward(decode))
            verify = [
                ScheduledSequence([50 + i, 7, 9, 11], len(p) + 1, [t], True) for i, (p, t) in enumerate(zip(prompts, tables))
            ]
            hidden = forward(verify)
            return prefill_logits.float(), decode_logits.float(), model.compute_logits(hidden).float()

    # Prefill: native elementwise stages around torch matmuls; decode: one native call per
    # layer up to fused_decode.MAX_ROWS requests, the native stages beyond.
    fused_rows: list[int] = []
    fused_runner = paths.get("fused").fused
    fused_run = fused_runner.run

    def counted_run(hidden, *args):  # noqa: ANN001, ANN202
        fused_rows.append(hidden.shape[0])
        return fused_run(hidden, *args)

    fused_runner.run = counted_run
    native = prefill_and_decode_logits()
    # The decode step and (3 requests) the 12-row verification step take the one-call layer.
    assert fused_rows == ([num_requests, 4 * num_requests] if 4 * num_requests <= MAX_ROWS else [num_requests] if num_requests <= MAX_ROWS else [])
    del fused_runner.run
    fused_decode = paths.get("fused")
    native_layers = prefill_and_decode_logits(paths=paths.without("fused"))  # decode through the native stages too
    native_layers_runner = paths.get("layers")
    eager = paths.without("fused", "layers")
    assert eager.names == ["eager"]
    kernel_only = prefill_and_decode_logits(paths=eager)  # PyTorch layers, native linear
    set_linear_kernels(model, None)
    torch_only = prefill_and_decode_logits(paths=eager)
    float32 = prefill_and_decode_logits(float32_model, StepPaths.for_model(float32_model))
    # bf16 computations of the float32 function: equal to bf16 rounding, and each row's
    # argmax is float32's or ties with it to bf16 rounding (random weights give near-ties
    # among 30 prefill rows).
    def error(logits, reference):  # noqa: ANN001, ANN202
        return float((logits - reference).norm() / reference.norm())

    for run in (native, native_layers, kernel_only, torch_only):
        for logits, reference in zip(run, float32, strict=True):
            assert error(logits, reference) < 2e-2
            picked = reference.gather(1, logits.argmax(-1, keepdim=True)).squeeze(1)
            assert bool((reference.max(-1).values - picked <= 0.1).all())  # ~3 bf16 steps at 4-8
            assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9
    # The native paths keep the residual stream, rotary and activations in float32 and
    # give float32 logits: closer to float32 than PyTorch's bf16 layers, on every step
    # (measured 0.55-0.78 of its error on these models).
    for run in (native, native_layers):
        for logits, torch_logits, reference in zip(run, torch_only, float32, strict=True):
            assert error(logits, reference) < 0.85 * error(torch_logits, reference)
    # The native paths are not copies of the PyTorch one: they differ by rounding.
    assert not torch.equal(native_layers[0], kernel_only[0]) and native_layers_runner is not None
    assert not torch.equal(native[1], kernel_only[1]) and fused_decode is not None


@needs_kernel
@pytest.mark.slow
def test_smollm2_bf16_native_decode_as_close_to_float32_as_torch_bf16(smollm2_path):
    # The two bf16 paths round differently, so neither equals the other; each is judged by
    # its distance from the float32 model on the same greedy tokens.
    from pagellm import LLM, SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    reference = LLM(str(smollm2_path), dtype="float32", max_model_len=256).generate(prompts, params, use_tqdm=False)
    from pagellm.model.native.after_load import set_linear_kernels

    llm = LLM(str(smollm2_path), dtype="bfloat16", max_model_len=256)
    runner = llm.engine.runner
    assert runner.step_paths.get("fused") is not None
    native = llm.generate(prompts, params, use_tqdm=False)
    runner.step_paths = runner.step_paths.without("fused", "layers")
    set_linear_kernels(runner.model, None)
    torch_bf16 = llm.generate(prompts, params, use_tqdm=False)

    def distance(outputs) -> float:
        """Mean |logprob - float32 logprob| of float32's greedy tokens, over the steps
        before the run's first token that differs from float32's."""
        diffs = []
        for out, ref in zip(outputs, reference):
            for token, got, want in zip(ref.outputs[0].token_ids, out.outputs[0].logprobs, ref.outputs[0].logprobs):
                if token not in got:
                    break
                diffs.append(abs(got[token].logprob - want[token].logprob))
        assert len(diffs) >= 12
        return sum(diffs) / len(diffs)

    assert distance(native) <= 1.5 * distance(torch_bf16) + 0.01
