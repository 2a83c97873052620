"""Tiny random-weight HF checkpoints built in the test run (no hub access)."""

from __future__ import annotations

from pathlib import Path

import torch

TINY_SHAPE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def make_tiny_hf_checkpoint(
    folder: Path, arch: str = "llama", seed: int = 0, **overrides: object
) -> Path:
    """Save a random tiny Llama/Qwen2/Mistral model as an HF folder; return its path."""
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }
    config_cls, model_cls = classes[arch]
    shape = {**TINY_SHAPE, "rope_theta": 10000.0, "tie_word_embeddings": False}
    shape.update(overrides)
    if arch == "mistral":
        shape.setdefault("sliding_window", None)
    config = config_cls(bos_token_id=1, eos_token_id=2, **shape)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    # Default init leaves tiny weights whose greedy output collapses into repeating one
    # token; wider weights make the output varied, so a mismatch would show.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.8, 1.2)
            elif "embed" in name:
                # A tied head reads the embedding too: keep it moderate there.
                param.normal_(0.0, 0.3 if config.tie_word_embeddings else 1.0)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
            else:
                param.normal_(0.0, 0.15)
    model.save_pretrained(folder, safe_serialization=True)
    write_byte_tokenizer(folder, shape["vocab_size"])
    return folder


def write_byte_tokenizer(folder: Path, vocab_size: int) -> None:
    """A byte-level tokenizer with one token per byte (ids 0-255) plus specials."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_tokens = sorted(alphabet, key=lambda ch: _byte_of(ch))
    vocab = {token: i for i, token in enumerate(byte_tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(folder / "tokenizer.json"))
    template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    config = {
        "bos_token": byte_tokens[1],
        "eos_token": byte_tokens[2],
        "add_bos_token": False,
        "chat_template": template,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def _byte_of(ch: str) -> int:
    """The byte a GPT-2 byte-level character stands for."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    code = ord(ch)
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


def load_hf_reference(folder: Path) -> torch.nn.Module:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.eval()
