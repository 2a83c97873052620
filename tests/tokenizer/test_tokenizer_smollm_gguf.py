"""The SmolLM2 GGUF tokenizer against HF transformers' tokenizer built from the same file."""

from __future__ import annotations

import random
import unicodedata

import pytest

# Texts on which the smollm digit rule plays no part (no numeric characters): ours must
# encode them exactly as HF does.
TEXTS = [
    "",
    "Hello world",
    "Hello, world! How are you today?",
    "  leading spaces",
    "trailing spaces   ",
    "a  b   c    d",
    "tabs\tand\t\ttabs",
    "newlines\nand\n\n\nmore\r\nwindows\r\n",
    " \t \n \r\n mixed \u00a0 whitespace \u3000 ",
    "\n\n\n",
    "I'm sure they've said it's what we'd do, don't you think? THEY'RE LOUD",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber \u00c5ngstr\u00f6m se\u00f1or",
    "e\u0301 (combining accent) vs \u00e9",
    "\u4e2d\u6587\u5206\u8bcd\u6d4b\u8bd5\uff0c\u4f60\u597d\u4e16\u754c\u3002",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3068\u30ab\u30bf\u30ab\u30ca",
    "\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645",
    "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440!",
    "emoji \U0001f600\U0001f389 \U0001f44d\U0001f3fd flags \U0001f1eb\U0001f1f7",
    "family \U0001f469\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466 and \U0001f3f3\ufe0f\u200d\U0001f308",
    "zero\u200bwidth\u200cjoiner\u200dtext\ufeff",
    "control \x00 \x1b[ escape \x7f",
    "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "<|endoftext|><|endoftext|>text<|im_end|>",
    "no space<|im_start|>around<|im_end|>tokens",
    "<|im_start partial and |im_end|> fake <|unknown|>",
    "<file_sep><filename>x.py<jupyter_code>print<jupyter_output>",
    "def f(x):\n    return x * two  # comment\n\tif x:\n\t\tpass\n",
    'const s = `template ${value}`; // JS\nif (a && b || !c) { return {"k": [null]}; }',
    "<html><body class=\"main\">&amp; &lt;tag&gt;</body></html>",
    "!!!??? ... --- *** ((())) [[]] {{}} @@ ## $$ %% ^^ && __ ++ == ~~ `` ||",
    "https://example.com/path?query=value&other=thing#frag",
    "word" * 50,
    " ".join(["repeated"] * 40),
]

# Texts where the smollm rule (every numeric character on its own, before the GPT-2 regex)
# matters. HF's GGUF converter has no entry for pre-tokenizer "smollm" and splits with the
# plain GPT-2 regex, which yields different ids here: "a  1" is ['a', 'Ġ', 'Ġ', '1'] in HF
# but ['a', 'ĠĠ', '1'] under the smollm rule, which is what llama.cpp and SmolLM2's own
# tokenizer.json (Digits(individual_digits) + ByteLevel) produce. So these are checked
# against that rule instead of against HF.
DIGIT_TEXTS = [
    "123 4567",
    "x 2024 y",
    "a  1",
    "  12\n\n34",
    "3.14159 and 2.71828",
    "v1.2.3-rc4",
    "abc123def",
    "\t42\t",
    "phone: +1 (555) 010-9999",
    "\u00bd \u00b2 \u0663 \uff11\uff12 \u2163",
    "year\n\n\n2024\n",
]


def _is_numeric(char: str) -> bool:
    return unicodedata.category(char).startswith("N")


def test_equality_texts_have_no_numeric_characters() -> None:
    for text in TEXTS:
        assert not any(_is_numeric(c) for c in text), text


@pytest.mark.parametrize("add_special_tokens", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_hf(smollm, hf_smollm, text: str, add_special_tokens: bool) -> None:
    assert smollm.encode(text, add_special_tokens=add_special_tokens) == hf_smollm.encode(
        text, add_special_tokens=add_special_tokens
    )


def test_encode_batch_matches_encode(smollm) -> None:
    assert smollm.encode_batch(TEXTS) == [smollm.encode(text) for text in TEXTS]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_hf(smollm, hf_smollm, text: str, skip_special_tokens: bool) -> None:
    ids = hf_smollm.encode(text, add_special_tokens=False)
    assert smollm.decode(ids, skip_special_tokens=skip_special_tokens) == hf_smollm.decode(
        ids, skip_special_tokens=skip_special_tokens
    )


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_arbitrary_ids_matches_hf(smollm, hf_smollm, skip_special_tokens: bool) -> None:
    # Random id sequences include broken UTF-8 (halves of multi-byte characters) and
    # special tokens in odd places; both sides must render them identically.
    rng = random.Random(1234)
    for _ in range(50):
        ids = [rng.randrange(smollm.vocab_size) for _ in range(rng.randint(1, 40))]
        ids += [rng.randrange(17) for _ in range(rng.randint(0, 3))]  # special tokens
        rng.shuffle(ids)
        assert smollm.decode(ids, skip_special_tokens) == hf_smollm.decode(
            ids, skip_special_tokens=skip_special_tokens
        ), ids


@pytest.mark.parametrize("text", TEXTS + DIGIT_TEXTS)
def test_round_trip(smollm, text: str) -> None:
    assert smollm.decode(smollm.encode(text), skip_special_tokens=False) == text


def test_skip_special_tokens_drops_control_tokens(smollm) -> None:
    ids = smollm.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert smollm.decode(ids, skip_special_tokens=True) == "user\nhi"
    assert smollm.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_convert_ids_to_tokens_matches_hf(smollm, hf_smollm) -> None:
    ids = hf_smollm.encode("Hello \u4e16\u754c <|im_end|> \U0001f600", add_special_tokens=False)
    assert smollm.convert_ids_to_tokens(ids) == hf_smollm.convert_ids_to_tokens(ids)
    assert smollm.convert_ids_to_tokens(list(range(300))) == hf_smollm.convert_ids_to_tokens(list(range(300)))


def _pieces(text: str) -> list[str]:
    """`text` cut so that every numeric character stands alone."""
    pieces: list[str] = []
    current = ""
    for char in text:
        if _is_numeric(char):
            if current:
                pieces.append(current)
            pieces.append(char)
            current = ""
        else:
            current += char
    if current:
        pieces.append(current)
    return pieces


@pytest.mark.parametrize("text", DIGIT_TEXTS)
def test_digits_follow_smollm_rule(smollm, hf_smollm, text: str) -> None:
    # The smollm rule cuts numeric characters out first and then byte-level BPE runs on
    # each piece on its own; HF's GPT-2 splitting applied piece by piece is therefore an
    # independent reference for the rule.
    expected = [token_id for piece in _pieces(text) for token_id in hf_smollm.encode(piece, add_special_tokens=False)]
    assert smollm.encode(text) == expected


@pytest.mark.parametrize("text", DIGIT_TEXTS)
def test_no_token_mixes_a_digit_with_other_text(smollm, text: str) -> None:
    encoding = smollm.backend.encode(text)
    for start, end in encoding.offsets:
        span = text[start:end]
        if any(_is_numeric(c) for c in span):
            assert len(span) == 1, (span, encoding.tokens)


def test_digit_rule_examples(smollm) -> None:
    assert smollm.convert_ids_to_tokens(smollm.encode("a  1")) == ["a", "\u0120\u0120", "1"]
    assert smollm.convert_ids_to_tokens(smollm.encode("x 2024")) == ["x", "\u0120", "2", "0", "2", "4"]
    assert smollm.convert_ids_to_tokens(smollm.encode("  12\n\n34")) == [
        "\u0120\u0120",
        "1",
        "2",
        "\u010a\u010a",
        "3",
        "4",
    ]


def test_special_token_attributes(smollm, hf_smollm) -> None:
    assert smollm.vocab_size == len(hf_smollm) == 49152
    assert (smollm.bos_token_id, smollm.bos_token) == (1, "<|im_start|>")
    assert (smollm.eos_token_id, smollm.eos_token) == (2, "<|im_end|>")
    assert smollm.pad_token_id == hf_smollm.pad_token_id == 2
    assert smollm.unk_token_id == 0
    assert smollm.bos_token == hf_smollm.bos_token and smollm.eos_token == hf_smollm.eos_token
    assert smollm.add_bos_token is False and smollm.add_eos_token is False
    # Every CONTROL token of the file (ids 0..16) is special, not only the named ones.
    assert smollm.all_special_ids == list(range(17))
    assert set(hf_smollm.all_special_ids) <= set(smollm.all_special_ids)
    assert smollm.chat_template is not None and "<|im_start|>" in smollm.chat_template


def test_eos_token_ids_merge_extra_ids(smollm) -> None:
    assert smollm.eos_token_ids == frozenset({2})
    wider = smollm.with_extra_eos_token_ids([0, 2])
    assert wider.eos_token_ids == frozenset({0, 2})
    assert smollm.eos_token_ids == frozenset({2})  # the original is unchanged
    assert wider.encode("hi") == smollm.encode("hi")
