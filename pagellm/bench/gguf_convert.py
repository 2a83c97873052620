"""Bench stage: rewrite a GGUF with every tensor dequantized to one float type.

llama.cpp runs a GGUF as stored; to compare it with pagellm at equal work (the same
weights in bf16 or f32, the same bytes read per token), the quantized file is rewritten
with its metadata unchanged and each tensor dequantized, then stored as BF16 or F32
(1-D norms stay F32, as llama.cpp's own converter keeps them).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

_TARGETS = {"bfloat16": "BF16", "float32": "F32"}


def write_float_gguf(source: Path, target: Path, dtype: str) -> Path:
    """Write `source` to `target` with tensors in `dtype` ("bfloat16" or "float32")."""
    import gguf

    if dtype not in _TARGETS:
        raise ValueError(f"dtype must be one of {sorted(_TARGETS)}, got {dtype!r}")
    quant_type = gguf.GGMLQuantizationType[_TARGETS[dtype]]
    reader = gguf.GGUFReader(str(source))
    arch = reader.get_field("general.architecture").contents()
    writer = gguf.GGUFWriter(str(target), arch=arch)
    for field in reader.fields.values():
        # The writer sets these itself; tensor layout fields are not metadata.
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), value_type, sub_type)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16 if dtype == "bfloat16" else gguf.LlamaFileType.ALL_F32)
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        if values.ndim == 1 or quant_type == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(tensor.name, values)
        else:
            # The writer reads a raw type's shape in bytes.
            packed = gguf.quants.quantize(values, quant_type).view(np.uint8)
            writer.add_tensor(tensor.name, packed, raw_dtype=quant_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target
