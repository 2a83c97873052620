"""Model stage: build a model and fill it with a checkpoint's weights (or random ones)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import torch

from pagellm.attention.backend import AttentionBackend
from pagellm.config.engine_args import QUANTIZATION_CHOICES
from pagellm.config.model import ModelConfig, ModelSource
from pagellm.errors import ConfigError
from pagellm.kernels.weights import WeightPart, WeightType, kernels_support, quantize_int8_rows
from pagellm.model.llama import LlamaForCausalLM
from pagellm.model.registry import model_class
from pagellm.model.tensor_parallel import TPGroup, TPLayout, shard_float
from pagellm.kernels.linear_bindings import cpu_linear_kernels
from pagellm.model.checkpoint import gguf_reader
from pagellm.model.loader import gguf_loader, hf_loader
from pagellm.model.loader.checkpoint_layouts import language_model_name, split_fused
from pagellm.model.loader.mxfp4_experts import mxfp4_experts
from pagellm.model.native.after_load import prepare_cpu_kernels

logger = logging.getLogger(__name__)


def load_model(
    source: ModelSource,
    config: ModelConfig,
    backend: AttentionBackend,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    load_format: str = "auto",
    quantization: str = "auto",
    tp: TPGroup | None = None,
    int8_activations: bool = False,
) -> LlamaForCausalLM:
    """Build the model on `device` in `dtype` and fill it from the checkpoint, or with
    random weights (load_format "dummy": only the checkpoint's config is read). With `tp`,
    this tensor-parallel rank's share of it.

    quantization "auto": a GGUF's quantized linear layers and embedding stay as stored
    where the CPU kernels run them (bf16 on an x86-64 CPU with AVX2 or more), float checkpoints
    load as they are; "none": everything is dequantized to `dtype`; "int8": the linear
    layers and embedding of a float checkpoint become int8 rows with per-row scales.
    int8_activations: the CPU kernels may multiply Q4_0 / Q4_1 weights with activations
    rounded to int8 (kernels/linear_bindings.py CpuLinearKernels).
    """
    start = time.perf_counter()
    keep_types = _plan_quantization(source, quantization, dtype, device, load_format)
    divisors = None
    weights = None
    if source.format == "gguf":
        reader = gguf_reader.open_gguf(source.path)
        if load_format != "dummy":
            weights = gguf_loader.iter_gguf_weights(reader, config, keep_types, None if tp is None else tp.layout)
        divisors = gguf_loader.rope_freq_divisors(reader)
    elif load_format != "dummy":
        stored = mxfp4_experts(
            hf_loader.iter_hf_weights(source.path), WeightType.MXFP4 in keep_types, None if tp is None else tp.layout
        )
        weights = _unfused(stored, config)
        if tp is not None:
            weights = _sharded(weights, tp.layout)
    if weights is not None and quantization == "int8":
        weights = _int8_rows(weights)
    # bf16 on an x86-64 CPU with AVX2 or more: every linear layer is built on the CPU kernels.
    on_cpu_bf16 = torch.device(device).type == "cpu" and dtype == torch.bfloat16
    kernel = cpu_linear_kernels(int8_activations) if on_cpu_bf16 else None
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        # With a checkpoint to read, the layers are built without memory (meta) and each
        # parameter is created as its tensor arrives, so weights kept quantized never
        # exist in float, not even for a moment.
        with torch.device("meta" if weights is not None else device):
            local_config = config if tp is None else tp.layout.local_config(config)
            model = model_class(config)(local_config, backend, rope_freq_divisors=divisors, tp=tp, kernel=kernel)
        with torch.device(device):
            model.rotary, model.local_rotary = model.rotary_tables_for(config, divisors)
    finally:
        torch.set_default_dtype(previous_dtype)
    if weights is None:
        _fill_random(model)
    else:
        model.load_weights(weights, device=device)
        if source.format == "gguf":
            gguf_reader.release_resident_pages(reader)
    model.eval()
    if kernel is not None:
        prepare_cpu_kernels(model)
    logger.info(
        "loaded %s (%s%s, %.1fM parameters, %s) in %.1fs; weights: %s",
        source.name,
        source.format,
        ", random weights" if weights is None else "",
        model_parameter_count(model) / 1e6,
        str(dtype).removeprefix("torch."),
        time.perf_counter() - start,
        describe_weight_bytes(model),
    )
    return model


def model_parameter_count(model: LlamaForCausalLM) -> int:
    """Parameters of the model as a float model would have them (packed layers included)."""
    total = sum(p.numel() for p in model.parameters())
    for module in model.modules():
        packed = getattr(module, "packed", None)
        if packed is not None:
            total += packed.out_features * packed.in_features
    return total


def describe_weight_bytes(model: LlamaForCausalLM) -> str:
    """e.g. '86 MiB (Q4_1 as stored 63 MiB, Q8_0 as stored 29 MiB, float32 0.1 MiB)'."""
    totals = model.weight_bytes_by_format()
    mib = 1024 * 1024
    ordered = sorted(totals.items(), key=lambda kv: -kv[1])
    parts = ", ".join(f"{name} {size / mib:.3g} MiB" for name, size in ordered)
    return f"{sum(totals.values()) / mib:.0f} MiB ({parts})"


def _plan_quantization(
    source: ModelSource, quantization: str, dtype: torch.dtype, device: torch.device | str, load_format: str
) -> frozenset[WeightType]:
    """The stored types to keep as they are; an explicit choice that cannot apply is an error."""
    if quantization not in QUANTIZATION_CHOICES:
        raise ConfigError(f"quantization must be one of {QUANTIZATION_CHOICES}, got {quantization!r}")
    if quantization == "none" or load_format == "dummy":
        if quantization == "int8" and load_format == "dummy":
            raise ConfigError("--quantization int8 needs real weights (not --load-format dummy)")
        return frozenset()
    on_cpu_bf16 = torch.device(device).type == "cpu" and dtype == torch.bfloat16
    supported = frozenset(
        t for t in WeightType if on_cpu_bf16 and t is not WeightType.BF16 and kernels_support(t)
    )
    if quantization == "int8":
        if WeightType.I8_ROW not in supported:
            raise ConfigError(
                "--quantization int8 runs on the CPU kernels: it needs --dtype bfloat16 on the CPU, "
                "x86-64 with AVX2 and a C compiler"
            )
        if source.format == "gguf":
            stored = gguf_loader.quantized_tensor_types(gguf_reader.open_gguf(source.path))
            if stored:
                name, kind = next(iter(stored.items()))
                raise ConfigError(
                    f"--quantization int8 quantizes float checkpoints; {source.path.name} is already "
                    f"quantized ({kind}, e.g. {name}): use --quantization auto to keep it as stored"
                )
        return frozenset()
    if source.format == "gguf" and not supported:
        stored = gguf_loader.quantized_tensor_types(gguf_reader.open_gguf(source.path))
        if stored:
            where = f"{str(dtype).removeprefix('torch.')} on {torch.device(device).type}"
            logger.info(
                "quantized weights dequantized (%s; they stay as stored with bfloat16 on an x86-64 CPU "
                "with AVX2 and a C compiler)", "no native kernels here" if on_cpu_bf16 else where,
            )  # fmt: skip
    return supported


Weights = Iterator[tuple[str, torch.Tensor | WeightPart]]


def _unfused(weights: Weights, config: ModelConfig) -> Weights:
    for name, tensor in weights:
        language_name = language_model_name(name)
        if language_name is not None:
            yield from split_fused(language_name, tensor, config)


def _sharded(weights: Weights, layout: TPLayout) -> Weights:
    for name, tensor in weights:
        # An HF folder's quantized parts (MXFP4 experts) arrive as this rank's share already.
        yield name, tensor if isinstance(tensor, WeightPart) else shard_float(layout, name, tensor)


def _int8_rows(weights: Weights) -> Weights:
    """Float linear and embedding weights as int8 rows (scale = max |w| / 127 per row)."""
    for name, tensor in weights:
        if isinstance(tensor, torch.Tensor) and tensor.dim() == 2 and gguf_loader.keepable(name):
            yield name, quantize_int8_rows(tensor)
        else:
            yield name, tensor


@torch.no_grad()
def _fill_random(model: LlamaForCausalLM, std: float = 0.02) -> None:
    """Random weights where they already are (on the device): norms at one, everything
    else small and normal, so activations stay finite through any number of layers."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(0)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.fill_(1.0)
        else:
            param.normal_(0.0, std, generator=generator)
