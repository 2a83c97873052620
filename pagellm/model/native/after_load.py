"""Model stage: the one pass after a bf16 CPU model's weights load (the loader calls it once):
Q4_0 / Q4_1 / MXFP4 weights repacked for the int8-activation kernel where it runs, every linear
layer (built on the CPU kernels) handed the plan measured for its shape group (the LM head
its own), each sparse layer its experts' native runner. Which forward runs a step is the
worker's (worker/step_paths/)."""

from __future__ import annotations

from torch import nn

from pagellm.kernels.build import load_kernels
from pagellm.kernels.linear_bindings import CpuLinearKernels
from pagellm.kernels.weights import VNNI_OF, PackedWeight, vnni_part
from pagellm.model.linear_plans import measure_linear_plans
from pagellm.model.mixture_of_experts import SparseMoeBlock
from pagellm.model.native.experts import NativeExperts
from pagellm.model.packable_layers import PackableEmbedding, PackableLinear


def prepare_cpu_kernels(model: nn.Module) -> None:
    """A model built on the CPU kernels (bf16, x86-64 with AVX2 or more), once its weights
    are loaded: each linear layer takes the kernel measured fastest for a step's rows
    (model/linear_plans.py). With int8 activations on a VNNI build, the Q4_0 / Q4_1 / MXFP4 weights
    are first repacked into that kernel's order."""
    kernel = model.cpu_linear_kernels
    assert kernel is not None, "the model was built without the CPU kernels"
    if kernel.int8_reads_repacked:
        repack_for_int8_activations(model)
    plans = measure_linear_plans(model, kernel)
    head = model.lm_head_module()
    for group in plans.groups:
        if group.module is head:
            model.lm_head_plan = plans.plan_of(group)
        else:
            for name in group.names:
                model.get_submodule(name).plan = plans.plan_of(group)
    model.linear_choice, model.linear_groups = plans.choice, plans.groups
    library = load_kernels()
    if library is not None:  # each sparse layer's experts in one C call (they read the plans)
        for module in model.modules():
            if isinstance(module, SparseMoeBlock) and NativeExperts.supports(module):
                module.native = NativeExperts(library, module)


def set_linear_kernels(model: nn.Module, kernel: CpuLinearKernels | None) -> None:
    """Route the linear layers (and the LM head) through `kernel` instead of what they were
    built with (None: torch): what tests and benchmarks compare."""
    model.cpu_linear_kernels = kernel
    for module in model.modules():
        if isinstance(module, PackableLinear):
            module.kernel = kernel


def repack_for_int8_activations(model: nn.Module) -> int:
    """With the int8-activation kernel on: every Q4_0 / Q4_1 / MXFP4 part of the model's packed
    layers in that kernel's lane order (kernels/weights.py vnni_part; the same bytes, so the
    same memory), one layer at a time. Dequantizing, gathering and the panel kernels read
    the new layout as well. Returns the number of parts repacked."""
    repacked = 0
    for module in model.modules():
        packed = getattr(module, "packed", None)
        if not isinstance(module, (PackableLinear, PackableEmbedding)) or packed is None:
            continue
        if any(part.type in VNNI_OF for part in packed.parts):
            k = packed.in_features
            parts = [vnni_part(part, k) if part.type in VNNI_OF else part for part in packed.parts]
            repacked += sum(part.type in VNNI_OF for part in packed.parts)
            module.use_packed(PackedWeight(parts, k))
    return repacked

