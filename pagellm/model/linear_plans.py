"""Model stage: the measured kernel choice of a bf16 CPU model's linear layers, attached at load.

Groups the model's linear layers by shape and weight types, times each group's candidates
on one of its layers (kernels/linear_choice.py: bounded, cached on disk), gives every
layer its plan and logs the table once. The LM head is chosen among the native kernels
only (streaming, GEMM, AMX where the CPU has it): they write float32 logits, oneDNN would
round them to bf16.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagellm.kernels import cpu_features
from pagellm.kernels.build import describe_isa, kernel_cache_dir, load_kernels, native_isa
from pagellm.kernels.linear_bindings import CpuLinearKernels, LinearImpl
from pagellm.kernels.linear_choice import DISTURBED_SHARE, NUM_BUCKETS, RULES_VERSION, LinearChoice, LinearPlan, LinearShape, resolve_choice
from pagellm.kernels.weights import PackedWeight, WeightPart, WeightType
from pagellm.model.packable_layers import PackableEmbedding, PackableLinear, apply_linear

logger = logging.getLogger(__name__)

# A timed candidate runs for at least this long (several calls at small shapes).
MIN_TIMED_SECONDS = 0.002
MAX_TIMED_CALLS = 50
TIMED_OUT_FEATURES = 4096
LONG_CALL_SECONDS = 0.02


@dataclass(frozen=True)
class LinearGroup:
    """Layers that share a shape and weight types, and so a plan."""

    shape: LinearShape
    names: tuple[str, ...]  # module names, e.g. layers.0.mlp.gate_up_proj
    module: PackableLinear | PackableEmbedding  # the one that is timed

    @property
    def label(self) -> str:
        kinds = sorted({name.rsplit(".", 1)[-1] for name in self.names})
        return f"{'/'.join(kinds)} {self.shape.n}x{self.shape.k} {'+'.join(self.shape.weight_types)}"


def _weight_types(module: PackableLinear | PackableEmbedding) -> tuple[str, ...]:
    if module.packed is not None:
        return tuple(t.label for t in module.packed.types)
    return (WeightType.BF16.label,)


def linear_groups(model: torch.nn.Module, kernel: CpuLinearKernels) -> list[LinearGroup]:
    """The model's linear layers (and LM head) grouped by what their choice depends on;
    `kernel`: the native implementations this machine runs (the head's candidates)."""
    members: dict[str, list[str]] = {}
    firsts: dict[str, tuple[LinearShape, PackableLinear | PackableEmbedding]] = {}
    head = model.lm_head_module()
    for name, module in [*((n, m) for n, m in model.named_modules() if isinstance(m, PackableLinear) and m is not head),
                         ("lm_head", head)]:  # fmt: skip
        n, k = (module.out_features, module.in_features) if isinstance(module, PackableLinear) else (
            module.num_embeddings, module.embedding_dim)  # fmt: skip
        native = kernel.native_impls(module.packed.types if module.packed is not None else ())
        candidates = native if module is head else (*native, LinearImpl.ONEDNN, LinearImpl.ONEDNN_F32)
        shape = LinearShape(n, k, _weight_types(module), candidates)
        members.setdefault(shape.key, []).append(name)
        firsts.setdefault(shape.key, (shape, module))
    return [LinearGroup(shape, tuple(members[key]), module) for key, (shape, module) in firsts.items()]


def seconds_per_call(run: Callable[[], object]) -> float:
    """Best mean time of `run()` over two rounds of calls lasting MIN_TIMED_SECONDS (a call
    longer than that is timed twice; one longer than LONG_CALL_SECONDS counts its warm-up
    as one of the two, where the warm-up's one-time costs are small beside the call)."""
    start = time.perf_counter()
    run()  # warm-up: caches, page faults, the kernels' per-thread buffers
    warm_up = time.perf_counter() - start
    start = time.perf_counter()
    run()
    single = time.perf_counter() - start
    if warm_up >= LONG_CALL_SECONDS:
        return min(warm_up, single)
    calls = max(1, min(MAX_TIMED_CALLS, int(MIN_TIMED_SECONDS / max(single, 1e-9))))
    best = single
    for _ in range(2 if calls > 1 else 1):  # one more call when a call alone is long enough
        start = time.perf_counter()
        for _ in range(calls):
            run()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def timed_out_features(shape: LinearShape) -> int:
    """How many of a layer's output features the measurement runs: at most
    TIMED_OUT_FEATURES. The kernels split the output features among the threads, so a
    slice of a few thousand times like the whole at a fraction of the cost (SmolLM2's LM
    head has 49152 rows: 0.8 s a call at 512 rows on a 2-core Zen 3)."""
    return min(shape.n, TIMED_OUT_FEATURES)


def _timed_slice(module: PackableLinear | PackableEmbedding, out_features: int) -> tuple[
        torch.Tensor | None, PackedWeight | None, torch.Tensor | None]:  # fmt: skip
    """The first rows of the layer's weight (of every stored part, in proportion, so the
    weight types keep their mix) and bias: (weight, packed, bias)."""
    bias = module.bias if isinstance(module, PackableLinear) else None
    total = module.packed.out_features if module.packed is not None else module.weight.shape[0]
    if out_features >= total:
        return module.weight, module.packed, bias
    if module.packed is None:
        return module.weight[:out_features], None, None if bias is None else bias[:out_features]
    parts, bias_pieces, offset = [], [], 0
    for part in module.packed.parts:
        rows = max(1, part.rows * out_features // total)
        scales = None if part.row_scales is None else part.row_scales[:rows]
        parts.append(WeightPart(part.type, part.data[:rows], scales))
        if bias is not None:
            bias_pieces.append(bias[offset : offset + rows])
        offset += part.rows
    sliced_bias = torch.cat(bias_pieces) if bias_pieces else None
    return None, PackedWeight(parts, module.packed.in_features), sliced_bias


def candidate_timer(
    groups: list[LinearGroup], kernel: CpuLinearKernels, whole_layers: bool = False
) -> Callable[[LinearShape, int, LinearImpl], float]:
    """Seconds per call of one candidate on a group's timed layer at `rows` random rows
    (float32 output, as the native layers ask for), on its first `timed_out_features` rows
    (`whole_layers`: on all of them, as the kernel benchmark checks the choice)."""
    slices = {
        g.shape.key: _timed_slice(g.module, g.shape.n if whole_layers else timed_out_features(g.shape)) for g in groups
    }
    generator = torch.Generator().manual_seed(0)

    def run(shape: LinearShape, x: torch.Tensor, impl: LinearImpl) -> Callable[[], torch.Tensor]:
        weight, packed, bias = slices[shape.key]
        plan = LinearPlan((impl,) * NUM_BUCKETS)
        return lambda: apply_linear(x, weight, packed, bias, kernel, plan, torch.float32)

    def time_candidate(shape: LinearShape, rows: int, impl: LinearImpl) -> float:
        return seconds_per_call(run(shape, torch.randn(rows, shape.k, generator=generator).to(torch.bfloat16), impl))

    # The first calls of a process pay once for the kernels' thread pool and per-thread
    # buffers (measured: 250 ms, then milliseconds for a few calls): not the first timed
    # candidate's cost.
    for group in groups:
        x = torch.zeros(1, group.shape.k, dtype=torch.bfloat16)
        for impl in group.shape.candidates:
            for _ in range(3):
                run(group.shape, x, impl)()
    return time_candidate


def choice_signature(num_threads: int) -> dict[str, object]:
    """Everything besides the shapes that the timings depend on (models that share their
    shapes share a cached choice)."""
    library = load_kernels()
    return {
        "cpu": cpu_features.cpu_signature(),
        "threads": num_threads,
        "torch": torch.__version__,
        "kernels": getattr(library, "_name", ""),
        "rules": RULES_VERSION,  # a choice made under other pruning rules is measured again
    }


@dataclass(frozen=True)
class LinearPlans:
    """The model's linear layers grouped by shape, and the plan chosen for each group."""

    choice: LinearChoice
    groups: list[LinearGroup]

    def plan_of(self, group: LinearGroup) -> LinearPlan:
        return self.choice.plans[group.shape.key]


def measure_linear_plans(model: torch.nn.Module, kernel: CpuLinearKernels) -> LinearPlans:
    """Measure (or read the cached choice of) every linear group's kernel per row bucket."""
    groups = linear_groups(model, kernel)
    signature = choice_signature(kernel.num_threads)
    with torch.inference_mode():
        choice = resolve_choice([g.shape for g in groups], candidate_timer(groups, kernel), signature, kernel_cache_dir())
    logger.info("%s", describe_choice(choice, groups))
    return LinearPlans(choice, groups)


def describe_choice(choice: LinearChoice, groups: list[LinearGroup]) -> str:
    """The startup log's table: where the choice came from, the ISA in use, a line per group."""
    how = {"measured": f"measured in {choice.seconds:.1f}s", "cache": "cached measurement", "forced": "forced by PAGELLM_LINEAR_KERNEL"}[choice.source]
    if choice.source == "measured" and choice.others_share is not None and choice.others_share > DISTURBED_SHARE:
        how += f", not cached: other processes used {100 * choice.others_share:.0f}% of the CPUs"
    lines = [f"linear kernels ({how}; {describe_isa()}):"]
    for group in groups:
        line = f"  {group.label}: rows {choice.plans[group.shape.key].describe()}"
        unmeasured = choice.unmeasured_buckets.get(group.shape.key)
        if unmeasured:
            line += f" ({len(unmeasured)} largest buckets not measured within the budget)"
        lines.append(line)
    return "\n".join(lines)


def kernel_info(model: torch.nn.Module) -> dict[str, str] | None:
    """What /metrics says of the CPU kernels: ISA levels, where the choice came from, and
    each linear group's plan (None when the model has no measured choice)."""
    if getattr(model, "linear_choice", None) is None:
        return None
    choice = model.linear_choice
    return {
        "cpu": cpu_features.cpu_model(),
        "native_isa": native_isa(),
        "onednn_isa": cpu_features.onednn_isa(),
        "choice": choice.source,
        "linear": "; ".join(f"{g.label}: {choice.plans[g.shape.key].describe()}" for g in model.linear_groups),
    }
