"""Bench stage: synthetic HF Llama checkpoints of real shapes, built offline.

A checkpoint folder holds config.json, a byte-level tokenizer and (optionally) random
weights in model.safetensors. Without weights the folder is meant for
`load_format="dummy"`, which draws random weights on the device: that is how a
Llama-3-8B-shaped model can be benchmarked on a machine that cannot download one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

# Token ids 1 and 2 are BOS / EOS in every preset; they are bytes of the byte tokenizer.
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2
NUM_BYTE_TOKENS = 256

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
    "smollm2-135m": dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    ),
    "llama-3-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    ),
}


def llama_config(shape: dict[str, Any]) -> Any:  # -> transformers.LlamaConfig
    """The transformers LlamaConfig of a shape (a preset from SHAPES or a custom dict)."""
    import transformers

    settings = {"rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}
    settings.update(shape)
    config = transformers.LlamaConfig(bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, **settings)
    # Loaders (pagellm's included) pick the model class by this field; only a saved
    # model would fill it in.
    config.architectures = ["LlamaForCausalLM"]
    return config


def write_synthetic_checkpoint(
    folder: str | Path,
    *,
    shape: dict[str, Any],
    with_weights: bool,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write an HF Llama checkpoint folder of `shape`; returns the folder.

    With `with_weights`, the weights are a random transformers model whose matrices are
    wider than the default init (see `widen_weights`) saved in `dtype`; without, only
    config.json and the tokenizer are written (for load_format="dummy").
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = llama_config(shape)
    if with_weights:
        import transformers

        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(config).to(torch.float32)
        widen_weights(model, seed=seed, tied=bool(config.tie_word_embeddings))
        model.to(dtype).save_pretrained(folder)
    # After the model (its save writes a config too): what the folder holds is this one.
    config.save_pretrained(folder)
    write_byte_tokenizer(folder)
    return folder


@torch.no_grad()
def widen_weights(model: torch.nn.Module, *, seed: int = 0, tied: bool = False) -> None:
    """Redraw every parameter so greedy decoding of the random model varies.

    The default init (std 0.02) makes a random model's greedy output collapse into one
    repeated token, so two engines would agree even if one were wrong. Matrices are
    drawn with std 1.2 / sqrt(fan_in) (0.15 at fan-in 64, as the test checkpoints use),
    which keeps activations of the same size at any width.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, param in model.named_parameters():
        if "norm" in name:
            values = torch.empty(param.shape).uniform_(0.8, 1.2, generator=gen)
        elif "embed" in name:
            # A tied LM head reads the embedding too: keep the logits moderate there.
            values = torch.empty(param.shape).normal_(0.0, 0.3 if tied else 1.0, generator=gen)
        elif name.endswith("bias"):
            values = torch.empty(param.shape).normal_(0.0, 0.1, generator=gen)
        else:
            fan_in = param.shape[-1]
            values = torch.empty(param.shape).normal_(0.0, 1.2 / math.sqrt(fan_in), generator=gen)
        param.copy_(values.to(param.dtype))


def write_byte_tokenizer(folder: str | Path) -> None:
    """A tokenizer with one token per byte (ids 0-255; 1 and 2 double as BOS and EOS).

    Ids past 255 (a large model's vocabulary) have no token: they decode to nothing,
    which is all a benchmark given token ids needs.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    folder = Path(folder)
    # The byte-level alphabet maps each byte to one printable character; order the
    # characters by the byte they stand for so token id == byte value.
    by_byte = {_byte_of_char(ch): ch for ch in pre_tokenizers.ByteLevel.alphabet()}
    vocab = {by_byte[b]: b for b in range(NUM_BYTE_TOKENS)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(folder / "tokenizer.json"))
    tokenizer_config = {
        "bos_token": by_byte[BOS_TOKEN_ID],
        "eos_token": by_byte[EOS_TOKEN_ID],
        "add_bos_token": False,
        "chat_template": (
            "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}"
        ),
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config), encoding="utf-8")


def _byte_of_char(ch: str) -> int:
    """The byte that a GPT-2 byte-level character stands for.

    Printable bytes stand for themselves; the others were shifted to code points 256+
    in byte order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    code = ord(ch)
    if code < 256 and code in printable:
        return code
    unprintable = [b for b in range(256) if b not in set(printable)]
    return unprintable[code - 256]
