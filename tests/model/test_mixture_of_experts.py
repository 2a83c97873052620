"""The mixture-of-experts block (model/mixture_of_experts.py): routing and expert-grouped
execution against a per-token reference written plainly here, at the edges (router ties,
an expert that gets no rows, every row to one expert)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagellm.config.model import ModelConfig
from pagellm.model.mixture_of_experts import SparseMoeBlock, route


def config(num_experts: int = 4, top_k: int = 2, renormalize: bool = True) -> ModelConfig:
    return ModelConfig(
        architecture="Qwen3MoeForCausalLM", vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6, num_experts=num_experts,
        num_experts_per_tok=top_k, moe_intermediate_size=24, norm_topk_prob=renormalize,
    )  # fmt: skip


def block(cfg: ModelConfig, seed: int = 0) -> SparseMoeBlock:
    torch.manual_seed(seed)
    moe = SparseMoeBlock(cfg)
    for param in moe.parameters():
        torch.nn.init.normal_(param, std=0.3)
    return moe


def per_token_reference(moe: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """Each token on its own: softmax over the router, top-k, each chosen expert's output
    weighted and summed in ascending expert order."""
    out = torch.zeros_like(x)
    for row in range(x.shape[0]):
        probs = torch.softmax((x[row] @ moe.gate.weight.T).double(), dim=-1)
        weights, chosen = torch.topk(probs, moe.top_k)
        if moe.renormalize:
            weights = weights / weights.sum()
        for weight, expert_id in sorted(zip(weights.tolist(), chosen.tolist()), key=lambda pair: pair[1]):
            expert = moe.experts[expert_id]
            gate, up = (x[row] @ expert.gate_up_proj.weight.T).split(expert.intermediate_size)
            out[row] += weight * ((F.silu(gate) * up) @ expert.down_proj.weight.T)
    return out


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_grouped_execution_equals_the_per_token_reference(rows, renormalize):
    moe = block(config(num_experts=8, top_k=3, renormalize=renormalize))
    x = torch.randn(rows, 32)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), per_token_reference(moe, x), rtol=1e-5, atol=1e-5)


def test_an_expert_with_no_rows_and_all_rows_to_one_expert():
    moe = block(config(num_experts=4, top_k=1))
    with torch.no_grad():
        moe.gate.weight.zero_()
        moe.gate.weight[2, 0] = 10.0  # expert 2 wins every row whose first feature is positive
    x = torch.randn(9, 32)
    x[:, 0] = x[:, 0].abs() + 0.5
    weights, experts = route(moe.gate(x), 1, True)
    assert experts.unique().tolist() == [2] and torch.all(weights == 1.0)
    calls = {i: 0 for i in range(4)}
    for i, expert in enumerate(moe.experts):
        expert.register_forward_hook(lambda module, args, out, i=i: calls.__setitem__(i, calls[i] + 1))
    with torch.no_grad():
        torch.testing.assert_close(moe(x), per_token_reference(moe, x), rtol=1e-5, atol=1e-5)
    assert calls == {0: 0, 1: 0, 2: 1, 3: 0}  # one call for all nine rows; the idle experts never run


def test_router_ties_pick_as_torch_topk_does_and_weights_split_evenly():
    logits = torch.zeros(3, 4)  # every expert scored alike
    weights, experts = route(logits, 2, renormalize=True)
    assert torch.equal(experts, torch.topk(torch.softmax(logits, -1), 2).indices)
    torch.testing.assert_close(weights, torch.full((3, 2), 0.5))
    unnormalized, _ = route(logits, 2, renormalize=False)
    torch.testing.assert_close(unnormalized, torch.full((3, 2), 0.25))


def test_a_config_with_more_chosen_than_experts_is_refused():
    from pagellm.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="num_experts_per_tok"):
        config(num_experts=2, top_k=3)


def test_the_startup_report_names_the_layout_and_the_experts():
    cfg = config(num_experts=8, top_k=2)
    line = cfg.describe()
    assert line.startswith("Qwen3MoeForCausalLM: 1 layers")
    assert "2 query / 1 KV heads of 16" in line and "experts: 8, 2 per token, 24 wide, in 1 layers" in line


def native_block(cfg: ModelConfig, impl: str | None = None):  # noqa: ANN201
    """A bf16 block on the CPU kernels, every linear on `impl` (None: by row count)."""
    from pagellm.kernels.build import load_kernels
    from pagellm.kernels.linear_bindings import LinearImpl, cpu_linear_kernels
    from pagellm.kernels.linear_choice import LinearPlan
    from pagellm.model.native.experts import NativeExperts

    library, kernel = load_kernels(), cpu_linear_kernels()
    if library is None or kernel is None:
        pytest.skip("the native bf16 kernels need x86-64 with AVX2 and a C compiler")
    moe = block(cfg).to(torch.bfloat16)
    plans = {}
    for expert in moe.experts:
        for name in ("gate_up_proj", "down_proj"):
            linear = getattr(expert, name)
            linear.kernel = kernel
            if impl is not None:  # one plan object per projection, as the measured plans are
                linear.plan = plans.setdefault(name, LinearPlan((LinearImpl[impl],) * 16))
    assert NativeExperts.supports(moe)
    moe.native = NativeExperts(library, moe)
    return moe


@pytest.mark.parametrize("impl", [None, "STREAMING", "GEMM"])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_native_experts_equal_the_per_token_reference(kernel_isa, rows, impl):
    """csrc/moe_experts.c on every kernel build the host runs: against the float reference
    on the same bf16 weights, within bf16 rounding (inputs, the activation, the routing
    weights' product)."""
    moe = native_block(config(num_experts=8, top_k=3), impl)
    x = torch.randn(rows, 32).to(torch.bfloat16)
    with torch.no_grad():
        weights, experts = route(moe.router_logits(x), moe.top_k, moe.renormalize)
        native = moe.native.run(x, weights, experts)
        assert native is not None and native.dtype is torch.float32
        reference = per_token_reference(moe.float(), x.float())
    torch.testing.assert_close(native, reference, rtol=3e-2, atol=3e-2 * float(reference.abs().mean()))


def test_native_experts_skip_idle_experts_and_fall_back_where_onednn_is_planned():
    moe = native_block(config(num_experts=4, top_k=1))
    with torch.no_grad():
        moe.gate.weight.zero_()
        moe.gate.weight[2, 0] = 10.0
    x = torch.randn(9, 32)
    x[:, 0] = x[:, 0].abs() + 0.5
    x = x.to(torch.bfloat16)
    with torch.no_grad():
        out = moe(x)  # every row to expert 2, the others idle
        torch.testing.assert_close(out.float(), per_token_reference(moe.float(), x.float()), rtol=3e-2, atol=3e-2)
    from pagellm.kernels.linear_bindings import LinearImpl
    from pagellm.kernels.linear_choice import LinearPlan

    moe = native_block(config(num_experts=4, top_k=2))
    onednn = LinearPlan((LinearImpl.ONEDNN,) * 16)
    for expert in moe.experts:
        expert.gate_up_proj.plan = onednn
    x = torch.randn(3, 32).to(torch.bfloat16)
    with torch.no_grad():
        weights, experts = route(moe.router_logits(x), moe.top_k, moe.renormalize)
        assert moe.native.run(x, weights, experts) is None  # the Python loop runs that step
        torch.testing.assert_close(moe(x).float(), per_token_reference(moe.float(), x.float()), rtol=3e-2, atol=3e-2)


def c_routing(logits: torch.Tensor, top_k: int, renormalize: bool):  # noqa: ANN201
    """csrc/moe_experts.c route_rows: offsets, rows and scales of the choices grouped by expert."""
    from pagellm.kernels.build import load_kernels

    library = load_kernels()
    if library is None:
        pytest.skip("the native kernels need x86-64 with AVX2 and a C compiler")
    m, num_experts = logits.shape
    logits = logits.float().contiguous()
    offsets = torch.empty(num_experts + 1, dtype=torch.int64)
    rows = torch.empty(m * top_k, dtype=torch.int64)
    scales = torch.empty(m * top_k, dtype=torch.float32)
    library.route_rows(logits.data_ptr(), m, num_experts, top_k, int(renormalize), offsets.data_ptr(),
                       rows.data_ptr(), scales.data_ptr())  # fmt: skip
    return offsets, rows, scales


@pytest.mark.parametrize("renormalize", [True, False])
def test_the_decode_layers_routing_in_c_equals_route(renormalize):
    """The one-call decode layer routes in C: each row's experts and weights as route()
    gives them, grouped by expert in ascending order with rows ascending within one."""
    logits = torch.randn(13, 16) * 3
    weights, experts = route(logits, 4, renormalize)
    offsets, rows, scales = c_routing(logits, 4, renormalize)
    expected_rows, expected_scales = [], []
    for expert in range(16):
        chosen = (experts == expert).nonzero().tolist()  # (row, slot), rows ascending
        assert int(offsets[expert + 1] - offsets[expert]) == len(chosen)
        expected_rows += [row for row, _ in chosen]
        expected_scales += [float(weights[row, slot]) for row, slot in chosen]
    assert int(offsets[0]) == 0 and int(offsets[-1]) == 13 * 4
    assert rows.tolist() == expected_rows
    torch.testing.assert_close(scales, torch.tensor(expected_scales), rtol=1e-6, atol=1e-7)


def test_the_decode_layers_routing_breaks_exact_ties_toward_the_lower_expert():
    # torch.topk leaves the order among exact ties unspecified; the C routing takes the
    # lower expert, so a step's choice does not depend on the build.
    offsets, rows, scales = c_routing(torch.zeros(2, 6), 3, renormalize=False)
    assert offsets.tolist() == [0, 2, 4, 6, 6, 6, 6]  # experts 0, 1 and 2, each for both rows
    assert rows.tolist() == [0, 1, 0, 1, 0, 1]
    torch.testing.assert_close(scales, torch.full((6,), 1 / 6))


def gpt_oss_config(limit: float = 0.8) -> ModelConfig:
    return ModelConfig(
        architecture="GptOssForCausalLM", vocab_size=16, hidden_size=32, intermediate_size=24, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6, num_experts=6,
        num_experts_per_tok=2, moe_intermediate_size=24, expert_bias=True, swiglu_limit=limit, swiglu_alpha=1.702,
        softmax_after_topk=True, attention_sinks=True,
    )  # fmt: skip


def gpt_oss_reference(moe, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    """Each token on its own, as transformers' gpt-oss: the router's top-k logits (with its
    bias) softmaxed, each chosen expert's biased projections, the clamped SwiGLU."""
    out = torch.zeros_like(x, dtype=torch.float64)
    for row in range(x.shape[0]):
        logits = (x[row].double() @ moe.gate.weight.double().T) + moe.gate.bias.double()
        top, chosen = torch.topk(logits, moe.top_k)
        for weight, expert_id in sorted(zip(torch.softmax(top, -1).tolist(), chosen.tolist()), key=lambda pair: pair[1]):
            expert = moe.experts[expert_id]
            gate_up = x[row].double() @ expert.gate_up_proj.weight.double().T + expert.gate_up_proj.bias.double()
            gate, up = gate_up.split(expert.intermediate_size)
            gate, up = gate.clamp(max=expert.limit), up.clamp(-expert.limit, expert.limit)
            act = (up + 1) * gate * torch.sigmoid(expert.alpha * gate)
            out[row] += weight * (act @ expert.down_proj.weight.double().T + expert.down_proj.bias.double())
    return out


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_gpt_oss_experts_in_python_and_in_c_equal_the_reference(kernel_isa, rows):
    """gpt-oss's block (model/gpt_oss.py): the router's bias, the experts' biases and the clamped
    SwiGLU (a limit of 0.8 clamps most gate and up values here), in the Python loop (float32) and
    in csrc/moe_experts.c (bf16, every kernel build the host runs)."""
    from pagellm.kernels.build import load_kernels
    from pagellm.kernels.linear_bindings import cpu_linear_kernels
    from pagellm.model.gpt_oss import GptOssMoeBlock
    from pagellm.model.native.experts import NativeExperts

    torch.manual_seed(rows)
    moe = GptOssMoeBlock(gpt_oss_config())
    for param in moe.parameters():
        torch.nn.init.normal_(param, std=0.3)
    x = torch.randn(rows, 32)
    with torch.no_grad():
        reference = gpt_oss_reference(moe, x)
        torch.testing.assert_close(moe(x).double(), reference, rtol=1e-5, atol=1e-5)
        unclamped = GptOssMoeBlock(gpt_oss_config(limit=1e6))
        unclamped.load_state_dict(moe.state_dict())
        assert (unclamped(x).double() - reference).abs().max() > 0.1, "the clamp must matter here"
    library, kernel = load_kernels(), cpu_linear_kernels()
    if library is None or kernel is None:
        pytest.skip("the native bf16 kernels need x86-64 with AVX2 and a C compiler")
    moe = moe.to(torch.bfloat16)
    for expert in moe.experts:
        expert.gate_up_proj.kernel = expert.down_proj.kernel = kernel
    assert NativeExperts.supports(moe)
    native = NativeExperts(library, moe)
    xb = x.to(torch.bfloat16)
    with torch.no_grad():
        weights, experts = moe.route(moe.router_logits(xb))
        out = native.run(xb, weights, experts)
        reference = gpt_oss_reference(moe.float(), xb.float())
    assert out is not None
    torch.testing.assert_close(out.double(), reference, rtol=3e-2, atol=3e-2 * float(reference.abs().mean()))
