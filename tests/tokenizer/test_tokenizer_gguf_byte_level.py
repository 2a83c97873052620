"""The "gpt2" (byte-level BPE) GGUF tokenizer on a tiny trained vocabulary, per pre-tokenizer."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import gguf
import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, pre_tokenizers, trainers

from pagellm.tokenizer import tokenizer_from_gguf_metadata
from pagellm.tokenizer.gguf_tokenizer import TokenType, byte_level_alphabet, respell_byte_level

CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = "<think>"
CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 12345 o'clock, isn't it?",
    "def main():\n    return [x ** 2 for x in range(10)]\n\n\n",
    "Caf\u00e9 \u00fcber na\u00efve \u4e2d\u6587\u5b57 \u65e5\u672c\u8a9e \U0001f600\U0001f600 2024-01-02",
    "    indented\tlines\r\n  and   spaces  ",
] * 10
TEXTS = [
    "The quick brown fox",
    "It's 12345 o'clock, isn't IT'S?",
    "numbers 1 22 333 4444 55555 123456789",
    "def main():\n    return [x ** 2 for x in range(10)]\n\n\n",
    "Caf\u00e9 \u00fcber \u4e2d\u6587 \U0001f600\U0001f469\u200d\U0001f467",
    "   spaces\t\ttabs\r\n\r\nnewlines  \n ",
    "<|im_start|>user\nhi<|im_end|><|endoftext|>",
    "let me <think> about it",
]


@pytest.fixture(scope="module")
def trained() -> dict[str, Any]:
    """Vocabulary (byte-level spelling) and merges of a small trained byte-level BPE."""
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=CONTROL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer=trainer)
    model = json.loads(backend.to_str())["model"]
    tokens = [token for token, _ in sorted(model["vocab"].items(), key=lambda item: item[1])]
    merges = [" ".join(merge) if isinstance(merge, list) else merge for merge in model["merges"]]
    return {"tokens": tokens, "merges": merges}


def byte_level_fields(trained: dict[str, Any], pre: str | None, **overrides: Any) -> dict[str, Any]:
    tokens = [*trained["tokens"], USER_DEFINED]
    token_types = [
        TokenType.CONTROL if token in CONTROL else TokenType.USER_DEFINED if token == USER_DEFINED else TokenType.NORMAL
        for token in tokens
    ]
    fields = {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [int(t) for t in token_types],
        "tokenizer.ggml.merges": list(trained["merges"]),
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 2,
    }
    fields.update(overrides)
    return {key: value for key, value in fields.items() if value is not None}


def write_byte_level_gguf(path: Path, fields: dict[str, Any]) -> Path:
    writer = gguf.GGUFWriter(str(path), fields["general.architecture"])
    writer.add_tokenizer_model("gpt2")
    if "tokenizer.ggml.pre" in fields:
        writer.add_tokenizer_pre(fields["tokenizer.ggml.pre"])
    writer.add_token_list(fields["tokenizer.ggml.tokens"])
    writer.add_token_types(fields["tokenizer.ggml.token_type"])
    writer.add_token_merges(fields["tokenizer.ggml.merges"])
    writer.add_bos_token_id(fields["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(fields["tokenizer.ggml.eos_token_id"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# Pre-tokenizers HF's GGUF loader knows the same way we do ("smollm" is tested on the real
# SmolLM2 vocabulary in test_tokenizer_smollm_gguf.py).
@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", None])
def test_matches_hf(trained: dict[str, Any], tmp_path: Path, pre: str | None) -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is the reference tokenizer")
    fields = byte_level_fields(trained, pre)
    path = write_byte_level_gguf(tmp_path / "tiny.gguf", fields)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    ours = tokenizer_from_gguf_metadata(fields)
    assert ours.vocab_size == len(hf)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf.encode(text), (pre, text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
        assert ours.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        # Llama 3 takes digits in threes and never joins a space to them.
        ("llama-bpe", ["x", "123", "45", " ", "678", "9"]),
        ("llama3", ["x", "123", "45", " ", "678", "9"]),
        ("qwen2", ["x", "1", "2", "3", "4", "5", " ", "6", "7", "8", "9"]),
        ("smollm", ["x", "1", "2", "3", "4", "5", " ", "6", "7", "8", "9"]),
        (None, ["x", "12345", " 6789"]),
        ("gpt2", ["x", "12345", " 6789"]),
    ],
)
def test_pre_tokenizer_by_name(trained: dict[str, Any], pre: str | None, pieces: list[str]) -> None:
    tokenizer = tokenizer_from_gguf_metadata(byte_level_fields(trained, pre))
    split = [piece for piece, _ in tokenizer.backend.pre_tokenizer.pre_tokenize_str("x12345 6789")]
    assert split == [respell_byte_level(piece) for piece in pieces]


def test_unknown_pre_tokenizer_warns_and_uses_gpt2(trained: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="pagellm.tokenizer.gguf_tokenizer"):
        tokenizer = tokenizer_from_gguf_metadata(byte_level_fields(trained, "some-new-model"))
    assert "some-new-model" in caplog.text
    split = [piece for piece, _ in tokenizer.backend.pre_tokenizer.pre_tokenize_str("x12345")]
    assert split == ["x", "12345"]


_BYTE_VALUE = {char: byte for byte, char in byte_level_alphabet().items()}


def test_tokens_written_as_plain_text_are_respelled(trained: dict[str, Any]) -> None:
    reference = tokenizer_from_gguf_metadata(byte_level_fields(trained, None))
    tokens = list(trained["tokens"])
    # A converter that wrote tokens as plain text: "Ġthe" as " the" (a real space is not in
    # the byte-level alphabet, so the loader must spell it "Ġ" again).
    plain = {token: bytes(_BYTE_VALUE[c] for c in token).decode("utf-8", "replace") for token in tokens}
    respelled = [
        plain[token] if token.startswith("\u0120") and "\ufffd" not in plain[token] else token for token in tokens
    ]
    assert respelled != tokens
    tokenizer = tokenizer_from_gguf_metadata(byte_level_fields({**trained, "tokens": respelled}, None))
    for text in TEXTS:
        assert tokenizer.encode(text) == reference.encode(text)
        assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text


def test_control_token_outside_the_byte_alphabet(trained: dict[str, Any]) -> None:
    # DeepSeek-style control tokens use characters outside the byte-level alphabet; they
    # are matched whole, keep their id and decode to their own text.
    special = "<\uff5cend\u2581of\u2581sentence\uff5c>"
    tokens = [*trained["tokens"], USER_DEFINED, special]
    overrides = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.eos_token_id": len(tokens) - 1}
    fields = byte_level_fields(trained, None, **overrides)
    fields["tokenizer.ggml.token_type"] = [*fields["tokenizer.ggml.token_type"], int(TokenType.CONTROL)]
    tokenizer = tokenizer_from_gguf_metadata(fields)
    assert tokenizer.vocab_size == len(tokens)
    ids = tokenizer.encode(f"hi{special}")
    assert ids[-1] == len(tokens) - 1 == tokenizer.eos_token_id
    assert tokenizer.eos_token == special
    assert tokenizer.decode(ids, skip_special_tokens=False) == f"hi{special}"
    assert tokenizer.decode(ids) == "hi"


def test_user_defined_token_is_whole_but_not_special(trained: dict[str, Any]) -> None:
    tokenizer = tokenizer_from_gguf_metadata(byte_level_fields(trained, None))
    think_id = len(trained["tokens"])
    ids = tokenizer.encode("a<think>b")
    assert think_id in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == "a<think>b"
    assert think_id not in tokenizer.all_special_ids


def test_byte_level_alphabet() -> None:
    alphabet = byte_level_alphabet()
    assert len(set(alphabet.values())) == 256
    assert set(alphabet.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    assert alphabet[ord(" ")] == "\u0120" and alphabet[ord("\n")] == "\u010a" and alphabet[ord("a")] == "a"
    assert respell_byte_level(" caf\u00e9") == "\u0120caf\u00c3\u00a9"
    assert respell_byte_level("\u0120the") == "\u0120the"
