"""Bench stage: GGUF files the way users get them: an F16 file quantized by llama.cpp's own
quantizer (llama-cpp-python's `llama_model_quantize`), so the per-tensor mixture of types
is whatever llama.cpp writes for a `Q4_K_M`, `Q3_K_M`, `IQ4_XS`... download, fallbacks for
rows that do not split into 256-wide super-blocks included.

Used by benchmarks/gguf_mixtures.py (a 1B-class model) and to make the small files of
tests/data/gguf_mixtures/ (tests/data/gguf_mixtures/regenerate.py).

Left out: the mixtures llama.cpp refuses without an importance matrix (IQ3_XXS, IQ2_XXS,
IQ2_XS, IQ2_S, IQ1_S, IQ1_M): `llama_model_quantize` takes one only as a pointer to a C++
`std::unordered_map` (the `imatrix` field of its parameters), which cannot be built through
the C interface, and llama-cpp-python ships no `llama-imatrix` tool to make one. Their
types are covered by the kernel tests on synthetic blocks (tests/kernels/test_quant_linear.py).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

# The mixtures made and checked: the common downloads.
MIXTURES = ("Q4_K_M", "Q5_K_M", "Q3_K_M", "Q2_K", "IQ4_XS", "IQ3_M")
# Refused by llama.cpp's quantizer without an importance matrix (see above).
NEEDS_IMATRIX = ("IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M")


class QuantizerUnavailable(RuntimeError):
    """llama-cpp-python is not installed (pip install llama-cpp-python)."""


def quantize(source: Path, target: Path, mixture: str, threads: int = 0) -> Path:
    """`source` (an F16 or F32 GGUF) quantized by llama.cpp to `mixture` (e.g. "Q4_K_M") at `target`."""
    try:
        import llama_cpp
    except ImportError as error:
        raise QuantizerUnavailable("llama.cpp's quantizer needs llama-cpp-python (pip install llama-cpp-python)") from error
    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{mixture}", None)
    if ftype is None:
        raise ValueError(f"llama.cpp has no mixture {mixture!r}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = threads
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params))
    if status != 0:
        reason = " (it needs an importance matrix)" if mixture in NEEDS_IMATRIX else ""
        raise RuntimeError(f"llama.cpp's quantizer failed on {mixture}{reason}: status {status}")
    return target


def tensor_types(path: Path) -> dict[str, str]:
    """Each tensor's stored type in a GGUF file."""
    import gguf

    return {t.name: gguf.GGMLQuantizationType(t.tensor_type).name for t in gguf.GGUFReader(str(path)).tensors}
