"""A float copy of a quantized GGUF (for llama.cpp at equal work with pagellm's dtype)
keeps the metadata and holds exactly the dequantized weights."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from gguf_models import write_gguf_from_hf
from hf_models import make_tiny_hf_checkpoint

from pagellm.bench.gguf_convert import write_float_gguf


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert")
    folder = make_tiny_hf_checkpoint(root / "hf", "llama", seed=2)
    cfg = json.loads((folder / "config.json").read_text())
    return write_gguf_from_hf(folder, root / "mixed.gguf", cfg)


def _dequantized(path):
    reader = gguf.GGUFReader(str(path))
    return reader, {t.name: (t.tensor_type, gguf.quants.dequantize(t.data, t.tensor_type)) for t in reader.tensors}


@pytest.mark.parametrize("dtype,stored", [("float32", "F32"), ("bfloat16", "BF16")])
def test_copy_keeps_metadata_and_dequantized_weights(quantized, tmp_path, dtype, stored):
    source_reader, source = _dequantized(quantized)
    assert any(kind not in (gguf.GGMLQuantizationType.F32,) for kind, _ in source.values())
    copy_reader, copy = _dequantized(write_float_gguf(quantized, tmp_path / "copy.gguf", dtype))
    assert copy.keys() == source.keys()
    for name, (kind, values) in copy.items():
        expected = source[name][1].astype(np.float32)
        if values.ndim == 1:
            assert kind == gguf.GGMLQuantizationType.F32
        else:
            assert kind == gguf.GGMLQuantizationType[stored]
        if kind == gguf.GGMLQuantizationType.BF16:
            expected = torch.from_numpy(expected).to(torch.bfloat16).float().numpy()
        np.testing.assert_array_equal(values, expected, err_msg=name)
    for key, field in source_reader.fields.items():
        if key.startswith("GGUF.") or key == "general.file_type":
            continue
        assert copy_reader.fields[key].contents() == field.contents(), key


def test_unknown_dtype_is_refused(quantized, tmp_path):
    with pytest.raises(ValueError, match="dtype must be one of"):
        write_float_gguf(quantized, tmp_path / "x.gguf", "int8")
