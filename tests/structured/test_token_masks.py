"""The batched mask application against a plain bit-by-bit reference, on random and on
grammar-like (mostly whole-word) masks, vocabularies that are and are not multiples of 32."""

import pytest
import torch

from pagellm.kernels.build import load_kernels
from pagellm.structured import token_masks
from pagellm.structured.token_masks import apply_masks


def reference(logits, bitmask, rows):
    out = logits.clone()
    for row in rows:
        for token in range(logits.shape[1]):
            if not (int(bitmask[row, token // 32]) >> (token % 32)) & 1:
                out[row, token] = float("-inf")
    return out


@pytest.mark.parametrize("native", [True, False], ids=["kernel", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [64, 100, 257])
@pytest.mark.parametrize("kind", ["random", "grammar-like"])
def test_masks_match_the_bitwise_reference(vocab, kind, dtype, native, monkeypatch):
    if native and load_kernels() is None:
        pytest.skip("no C compiler: the kernel path cannot be built here")
    if not native:
        monkeypatch.setattr(token_masks, "_apply_native", lambda *args: False)
    generator = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    if kind == "random":
        bitmask = torch.randint(-(2**31), 2**31 - 1, (4, words), dtype=torch.int32, generator=generator)
    else:
        bitmask = torch.zeros(4, words, dtype=torch.int32)
        bitmask[:, 0] = -1
        bitmask[1, -1] = 0b1011
        bitmask[2, words // 2] = -(2**31)  # bit 31 alone
    logits = torch.randn(4, vocab, generator=generator).to(dtype)
    rows = [0, 2, 3]  # row 1 is unconstrained: untouched
    got = logits.clone()
    apply_masks(got, bitmask, rows)
    assert torch.equal(got, reference(logits, bitmask, rows))
    assert torch.equal(got[1], logits[1])
