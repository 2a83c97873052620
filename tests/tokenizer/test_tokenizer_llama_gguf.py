"""The "llama" (SentencePiece BPE with byte fallback) GGUF tokenizer on a tiny vocabulary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import pytest
from tiny_sentencepiece import S, USER_DEFINED, tiny_sentencepiece_fields

from pagellm.errors import ModelLoadError
from pagellm.tokenizer import read_gguf_tokenizer_fields, tokenizer_from_gguf_metadata
from pagellm.tokenizer.gguf_tokenizer import TokenType, merges_from_scores

TEXTS = [
    "hello world",
    "Hello world, the test is a token!",
    "the tokenizer is testing",
    " leading space",
    "two  spaces   three",
    "trailing ",
    "\u00e9t\u00e9 caf\u00e9",  # é is not in the vocabulary: byte fallback
    "\u4e16\u754c \U0001f600 \U0001f469\u200d\U0001f467",
    "hello\nworld\ttab",
    "</s>hello<s> world",
    "call <tool> now",
    "",
]


def write_tokenizer_gguf(path: Path, fields: dict[str, Any]) -> Path:
    """A GGUF holding only tokenizer metadata (no tensors)."""
    writer = gguf.GGUFWriter(str(path), fields["general.architecture"])
    writer.add_tokenizer_model(fields["tokenizer.ggml.model"])
    writer.add_token_list(fields["tokenizer.ggml.tokens"])
    writer.add_token_scores(fields["tokenizer.ggml.scores"])
    writer.add_token_types(fields["tokenizer.ggml.token_type"])
    writer.add_bos_token_id(fields["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(fields["tokenizer.ggml.eos_token_id"])
    writer.add_unk_token_id(fields["tokenizer.ggml.unknown_token_id"])
    writer.add_chat_template(fields["tokenizer.chat_template"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_gguf(tmp_path_factory.mktemp("llama_tok") / "tiny.gguf", tiny_sentencepiece_fields())


@pytest.fixture(scope="module")
def ours(gguf_path: Path) -> Any:
    return tokenizer_from_gguf_metadata(read_gguf_tokenizer_fields(gguf_path))


@pytest.fixture(scope="module")
def hf(gguf_path: Path) -> Any:
    transformers = pytest.importorskip("transformers", reason="transformers is the reference tokenizer")
    return transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def test_fields_read_back_from_file(gguf_path: Path) -> None:
    fields = read_gguf_tokenizer_fields(gguf_path)
    expected = tiny_sentencepiece_fields()
    assert fields["tokenizer.ggml.tokens"] == expected["tokenizer.ggml.tokens"]
    assert fields["tokenizer.ggml.model"] == "llama"
    assert fields["tokenizer.ggml.bos_token_id"] == 1


@pytest.mark.parametrize("add_special_tokens", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_hf(ours, hf, text: str, add_special_tokens: bool) -> None:
    assert ours.encode(text, add_special_tokens=add_special_tokens) == hf.encode(
        text, add_special_tokens=add_special_tokens
    )


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_hf(ours, hf, text: str, skip_special_tokens: bool) -> None:
    ids = hf.encode(text)
    assert ours.decode(ids, skip_special_tokens=skip_special_tokens) == hf.decode(
        ids, skip_special_tokens=skip_special_tokens
    )


def test_bos_added_by_default(ours) -> None:
    # No tokenizer.ggml.add_bos_token key: llama.cpp (and HF) add BOS to SentencePiece vocabularies.
    assert ours.add_bos_token is True
    assert ours.encode("hello")[0] == 1
    assert ours.encode("hello", add_special_tokens=False)[0] != 1
    assert ours.eos_token_ids == frozenset({2})


def test_add_bos_false_from_metadata() -> None:
    tokenizer = tokenizer_from_gguf_metadata(tiny_sentencepiece_fields(**{"tokenizer.ggml.add_bos_token": False}))
    assert tokenizer.add_bos_token is False
    assert tokenizer.encode("hello") == tokenizer.encode("hello", add_special_tokens=False)


def test_end_of_turn_ids_end_generation() -> None:
    fields = tiny_sentencepiece_fields(**{"tokenizer.ggml.eot_token_id": 5, "tokenizer.ggml.eom_token_id": 6})
    assert tokenizer_from_gguf_metadata(fields).eos_token_ids == frozenset({2, 5, 6})


def test_add_eos_from_metadata() -> None:
    tokenizer = tokenizer_from_gguf_metadata(tiny_sentencepiece_fields(**{"tokenizer.ggml.add_eos_token": True}))
    assert tokenizer.encode("hello")[-1] == 2


def test_byte_fallback(ours) -> None:
    # "é" (C3 A9) and "世" (E4 B8 96) are not in the vocabulary: they become byte tokens.
    tokens = ours.convert_ids_to_tokens(ours.encode("caf\u00e9 \u4e16", add_special_tokens=False))
    assert tokens == [S, "c", "a", "f", "<0xC3>", "<0xA9>", S, "<0xE4>", "<0xB8>", "<0x96>"]
    for text in TEXTS:
        if "<" not in text and not text.startswith(" "):
            assert ours.decode(ours.encode(text)) == text


def test_leading_space_follows_hf(ours) -> None:
    # HF's Metaspace adds no "▁" in front of text that already starts with a space, and the
    # decoder then strips that space: " leading" comes back as "leading". (SentencePiece and
    # llama.cpp would prefix "▁▁leading" and give " leading" back.) We follow HF, our reference.
    ids = ours.encode(" leading", add_special_tokens=False)
    assert ours.convert_ids_to_tokens(ids)[0] == S
    assert ours.decode(ids) == "leading"


def test_words_and_spaces_by_hand(ours) -> None:
    # Worked out from the vocabulary: best-scored joins first, spaces as "▁", one "▁" in front.
    assert ours.convert_ids_to_tokens(ours.encode("hello world", add_special_tokens=False)) == [
        S + "hello",
        S + "world",
    ]
    assert ours.convert_ids_to_tokens(ours.encode("the token", add_special_tokens=False)) == [S + "the", S + "token"]
    assert ours.convert_ids_to_tokens(ours.encode("a  test", add_special_tokens=False)) == [S + "a", S, S + "test"]


def test_special_and_user_defined_tokens(ours) -> None:
    ids = ours.encode("</s>hello <tool>", add_special_tokens=False)
    tokens = ours.convert_ids_to_tokens(ids)
    assert tokens[0] == "</s>" and tokens[-1] == USER_DEFINED
    # </s> is special (dropped when skipping), <tool> is an ordinary added token (kept).
    assert ours.decode(ids, skip_special_tokens=True) == "hello <tool>"
    assert set(ours.all_special_ids) == {0, 1, 2}


def test_no_space_prefix() -> None:
    # HF's GGUF loader ignores tokenizer.ggml.add_space_prefix; llama.cpp honours it, so we do.
    tokenizer = tokenizer_from_gguf_metadata(tiny_sentencepiece_fields(**{"tokenizer.ggml.add_space_prefix": False}))
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids) == ["hello", S + "world"]
    assert tokenizer.decode(ids) == "hello world"
    assert tokenizer.decode(tokenizer.encode(" hello")) == " hello"


def test_explicit_merges_are_used() -> None:
    fields = tiny_sentencepiece_fields(**{"tokenizer.ggml.merges": ["h e", "l l"]})
    tokenizer = tokenizer_from_gguf_metadata(fields)
    tokens = tokenizer.convert_ids_to_tokens(tokenizer.encode("hello", add_special_tokens=False))
    assert tokens == [S, "he", "ll", "o"]


def test_merges_from_scores_rank_by_merged_token_score() -> None:
    tokens = ["a", "b", "c", "ab", "bc", "abc", "<s>"]
    scores = [-10.0, -10.0, -10.0, -2.0, -1.0, -0.5, 0.0]
    types = [TokenType.NORMAL] * 6 + [TokenType.CONTROL]
    assert merges_from_scores(tokens, scores, types) == [("ab", "c"), ("a", "bc"), ("b", "c"), ("a", "b")]


def test_unknown_character_without_byte_tokens_is_unk() -> None:
    fields = tiny_sentencepiece_fields()
    keep = [i for i, t in enumerate(fields["tokenizer.ggml.token_type"]) if t != TokenType.BYTE]
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        fields[key] = [fields[key][i] for i in keep]
    tokenizer = tokenizer_from_gguf_metadata(fields)
    ids = tokenizer.encode("\u00e9", add_special_tokens=False)
    assert 0 in ids  # <unk>


def test_chat_template_from_metadata(ours) -> None:
    assert ours.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user] hi"


def test_duplicated_token_keeps_ids(caplog: pytest.LogCaptureFixture) -> None:
    fields = tiny_sentencepiece_fields()
    fields["tokenizer.ggml.tokens"] = [*fields["tokenizer.ggml.tokens"], S + "hello"]
    fields["tokenizer.ggml.scores"] = [*fields["tokenizer.ggml.scores"], -99.0]
    fields["tokenizer.ggml.token_type"] = [*fields["tokenizer.ggml.token_type"], int(TokenType.NORMAL)]
    tokenizer = tokenizer_from_gguf_metadata(fields)
    assert "appears as ids" in caplog.text
    assert tokenizer.vocab_size == len(fields["tokenizer.ggml.tokens"])
    first = fields["tokenizer.ggml.tokens"].index(S + "hello")
    assert tokenizer.encode("hello", add_special_tokens=False) == [first]


def test_unsupported_tokenizer_type() -> None:
    with pytest.raises(ModelLoadError, match=r"'bert'.*supported: gpt2, llama"):
        tokenizer_from_gguf_metadata(tiny_sentencepiece_fields(**{"tokenizer.ggml.model": "bert"}))


def test_missing_metadata() -> None:
    with pytest.raises(ModelLoadError, match="tokenizer.ggml.tokens"):
        tokenizer_from_gguf_metadata({"tokenizer.ggml.model": "llama"})
    with pytest.raises(ModelLoadError, match="tokenizer.ggml.model"):
        tokenizer_from_gguf_metadata({})
    bad_types = tiny_sentencepiece_fields(**{"tokenizer.ggml.token_type": [1, 1]})
    with pytest.raises(ModelLoadError, match="token types"):
        tokenizer_from_gguf_metadata(bad_types)


def test_unreadable_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="cannot read GGUF"):
        read_gguf_tokenizer_fields(path)
