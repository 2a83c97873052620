"""Makes this folder's GGUF files: a tiny random Llama (tests/default_path.py's test model at
hidden 256, so that llama.cpp's K-quants apply, and an MLP width of 352, which is not a
multiple of 256, so that ffn_down takes llama.cpp's fallback types) written as F16, then
quantized by llama.cpp's own quantizer to each mixture of pagellm.bench.llamacpp_quantize.

    pip install llama-cpp-python && PYTHONPATH=tests python tests/data/gguf_mixtures/regenerate.py

The files are committed (about 0.5 MB each) so that the tests read real llama.cpp mixtures
without llama-cpp-python (a source build of several minutes) in CI.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import gguf
from default_path import make_default_path_checkpoint  # tests/ (PYTHONPATH=tests)
from gguf_models import write_gguf_from_hf

from pagellm.bench.llamacpp_quantize import MIXTURES, quantize, tensor_types

HERE = Path(__file__).resolve().parent

SHAPE = {"hidden_size": 256, "intermediate_size": 352, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2}  # fmt: skip
KINDS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "token_embd", "output")


def main() -> None:
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        folder = make_default_path_checkpoint(root / "hf", seed=5, **SHAPE)
        cfg = json.loads((folder / "config.json").read_text())
        f16 = write_gguf_from_hf(folder, root / "f16.gguf", cfg,
                                 quant_by_kind={kind: gguf.GGMLQuantizationType.F16 for kind in KINDS})  # fmt: skip
        for mixture in MIXTURES:
            target = quantize(f16, HERE / f"{mixture}.gguf", mixture, threads=2)
            kinds = sorted(set(tensor_types(target).values()))
            print(f"{mixture}: {target.stat().st_size / 1e6:.2f} MB, types {', '.join(kinds)}")


if __name__ == "__main__":
    main()
