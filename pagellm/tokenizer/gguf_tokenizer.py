"""Tokenizer stage: build the tokenizer a GGUF file describes in its metadata.

A GGUF carries no tokenizer.json, only llama.cpp's description of the vocabulary under
`tokenizer.ggml.*`. Two kinds are supported:

- "gpt2": byte-level BPE (SmolLM, Llama 3, Qwen2...). Text is split by a regex chosen by
  `tokenizer.ggml.pre`, each piece's UTF-8 bytes are spelled in the 256-character byte-level
  alphabet, then BPE applies the file's merges.
- "llama": SentencePiece-style BPE (Llama 2, TinyLlama, Mistral...). Spaces become `▁`,
  tokens are scored, and a character missing from the vocabulary falls back to its bytes
  (`<0xNN>` tokens).
"""

from __future__ import annotations

import enum
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import gguf
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from pagellm.errors import ModelLoadError
from pagellm.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

SUPPORTED_TOKENIZER_MODELS = ("gpt2", "llama")

_SENTENCEPIECE_SPACE = "\u2581"  # "▁"


class TokenType(enum.IntEnum):
    """llama.cpp's `tokenizer.ggml.token_type` values."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# Token types matched whole in the text before BPE runs, and whether they are special
# (dropped by decode(skip_special_tokens=True)). llama.cpp treats UNKNOWN like CONTROL.
_ADDED_TOKEN_TYPES = {TokenType.CONTROL: True, TokenType.UNKNOWN: True, TokenType.USER_DEFINED: False}

# Split regexes of the byte-level families, by `tokenizer.ggml.pre`. These are the patterns
# the vocabularies were trained with (tiktoken-style for Llama 3; Qwen2 differs only in
# taking digits one at a time).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLIT_REGEXES = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3", "falcon-h1", "pixtral", "lfm2"),
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
}
# Families that cut every digit out on its own first and then apply the GPT-2 regex:
# llama.cpp groups these together, and SmolLM's own tokenizer.json does the same
# (Digits(individual_digits) followed by ByteLevel).
_DIGITS_THEN_GPT2 = frozenset(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"))


def byte_level_alphabet() -> dict[int, str]:
    """The byte-level BPE spelling of each byte value.

    Bytes that are printable, non-space Latin-1 characters stand for themselves; the others
    (controls, space, a few Latin-1 gaps) are moved to code points from 256 upward, in byte
    order, so every token is printable text without whitespace.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling = {byte: chr(byte) for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in spelling:
            spelling[byte] = chr(256 + shifted)
            shifted += 1
    return spelling


_BYTE_SPELLING = byte_level_alphabet()
_BYTE_ALPHABET = frozenset(_BYTE_SPELLING.values())


def respell_byte_level(token: str) -> str:
    """`token` written in the byte-level alphabet (unchanged if it already is)."""
    if set(token) <= _BYTE_ALPHABET:
        return token
    return "".join(_BYTE_SPELLING[byte] for byte in token.encode("utf-8"))


# -- reading the metadata --------------------------------------------------------------------


def read_gguf_tokenizer_fields(reader: gguf.GGUFReader | str | os.PathLike[str]) -> dict[str, Any]:
    """The `tokenizer.*` metadata (and `general.architecture`) as plain Python values.

    Takes an open reader (the model loader shares its own) or a path.
    """
    if not isinstance(reader, gguf.GGUFReader):
        try:
            reader = gguf.GGUFReader(os.fspath(reader))
        except Exception as e:  # the reader raises ValueError, struct or index errors on bad bytes
            raise ModelLoadError(f"cannot read GGUF file {os.fspath(reader)!r}: {e}") from None
    fields: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.") or key == "general.architecture":
            fields[key] = field.contents()
    return fields


def tokenizer_from_gguf_file(path: str | os.PathLike[str]) -> Tokenizer:
    """The tokenizer of the GGUF file at `path`."""
    return tokenizer_from_gguf_metadata(read_gguf_tokenizer_fields(path))


def _require(fields: Mapping[str, Any], key: str) -> Any:
    if key not in fields:
        raise ModelLoadError(f"the GGUF tokenizer metadata lacks {key!r}")
    return fields[key]


def _optional_id(fields: Mapping[str, Any], key: str) -> int | None:
    value = fields.get(key)
    return None if value is None else int(value)


# -- building -------------------------------------------------------------------------------


def tokenizer_from_gguf_metadata(fields: Mapping[str, Any]) -> Tokenizer:
    """The tokenizer described by a GGUF file's `tokenizer.*` key/values."""
    model_type = _require(fields, "tokenizer.ggml.model")
    tokens: Sequence[str] = _require(fields, "tokenizer.ggml.tokens")
    token_types = _token_types(fields, len(tokens))
    if model_type == "gpt2":
        backend = _byte_level_backend(fields, tokens, token_types)
        default_add_bos = False
    elif model_type == "llama":
        backend = _sentencepiece_backend(fields, tokens, token_types)
        # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise.
        default_add_bos = True
    else:
        raise ModelLoadError(
            f"GGUF tokenizer type {model_type!r} (tokenizer.ggml.model) is not supported; "
            f"supported: {', '.join(SUPPORTED_TOKENIZER_MODELS)}"
        )
    _add_special_tokens(backend, tokens, token_types)
    highest_id = max(backend.get_vocab(with_added_tokens=True).values(), default=-1)
    if highest_id >= len(tokens):
        # An added token missed its id in the vocabulary and got a new one past the end,
        # which the model's embedding does not have.
        raise ModelLoadError(f"GGUF tokenizer: built token id {highest_id} from a vocabulary of {len(tokens)}")
    add_bos = fields.get("tokenizer.ggml.add_bos_token")
    add_eos = fields.get("tokenizer.ggml.add_eos_token")
    tokenizer = Tokenizer(
        backend,
        bos_token_id=_optional_id(fields, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_optional_id(fields, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_optional_id(fields, "tokenizer.ggml.padding_token_id"),
        unk_token_id=_optional_id(fields, "tokenizer.ggml.unknown_token_id"),
        add_bos_token=default_add_bos if add_bos is None else bool(add_bos),
        add_eos_token=bool(add_eos) if add_eos is not None else False,
        chat_template=fields.get("tokenizer.chat_template"),
        # End-of-turn / end-of-message ids (Llama 3's <|eot_id|>, <|eom_id|>) end generation
        # too, as llama.cpp treats them.
        extra_eos_token_ids=[
            token_id
            for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
            if (token_id := _optional_id(fields, key)) is not None
        ],
        vocab_size=len(tokens),
    )
    logger.debug("GGUF tokenizer: %s (%s, pre=%s)", tokenizer, model_type, fields.get("tokenizer.ggml.pre"))
    return tokenizer


def _token_types(fields: Mapping[str, Any], num_tokens: int) -> list[int]:
    token_types = fields.get("tokenizer.ggml.token_type")
    if token_types is None:
        return [TokenType.NORMAL] * num_tokens
    if len(token_types) != num_tokens:
        raise ModelLoadError(
            f"GGUF tokenizer: {len(token_types)} token types for {num_tokens} tokens (tokenizer.ggml.token_type)"
        )
    return [int(t) for t in token_types]


def _vocab(spellings: Sequence[str]) -> dict[str, int]:
    """token -> id, keeping the first id of a spelling that occurs twice."""
    vocab: dict[str, int] = {}
    for token_id, token in enumerate(spellings):
        if token in vocab:
            # The later id stays unreachable from text and decodes to nothing; the model
            # never produced it in training either, since its tokenizer could not.
            logger.warning("GGUF tokenizer: token %r appears as ids %d and %d", token, vocab[token], token_id)
            continue
        vocab[token] = token_id
    return vocab


def _bpe_model(**kwargs: Any) -> models.BPE:
    try:
        return models.BPE(**kwargs)
    except Exception as e:  # the Rust builder reports bad merges as a plain Exception
        raise ModelLoadError(f"GGUF tokenizer: the vocabulary and merges do not fit together ({e})") from None


def _split_merges(merges: Sequence[str]) -> list[tuple[str, str]]:
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep or not left or not right:
            raise ModelLoadError(f"GGUF tokenizer: malformed merge {merge!r} (expected 'left right')")
        pairs.append((left, right))
    return pairs


def _byte_level_backend(
    fields: Mapping[str, Any], tokens: Sequence[str], token_types: Sequence[int]
) -> tokenizers.Tokenizer:
    # Added tokens keep the spelling the file gives (their raw text: "<|im_end|>", "<think>"),
    # since they are matched in the raw text and decoded as-is. Every other token must be in
    # the byte-level alphabet for BPE to find it; a converter that wrote one as plain text
    # (e.g. with a real space) is respelled here.
    spellings = [
        token if token_type in _ADDED_TOKEN_TYPES else respell_byte_level(token)
        for token, token_type in zip(tokens, token_types)
    ]
    # GGUF writers drop empty arrays, so a vocabulary without merges has no merges key.
    merges = _split_merges(fields.get("tokenizer.ggml.merges") or [])
    backend = tokenizers.Tokenizer(_bpe_model(vocab=_vocab(spellings), merges=merges))
    backend.pre_tokenizer = _byte_level_pre_tokenizer(fields.get("tokenizer.ggml.pre"))
    backend.decoder = decoders.ByteLevel()
    return backend


def _byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    split = _PRE_SPLIT_REGEXES.get(pre or "")
    if split is not None:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre not in (None, "default", "gpt2", "gpt-2"):
        logger.warning("GGUF tokenizer: pre-tokenizer %r is not known; splitting text as GPT-2 does", pre)
    return gpt2


def _sentencepiece_backend(
    fields: Mapping[str, Any], tokens: Sequence[str], token_types: Sequence[int]
) -> tokenizers.Tokenizer:
    vocab = _vocab(tokens)
    merges_field = fields.get("tokenizer.ggml.merges")
    if merges_field:
        merges = _split_merges(merges_field)
    else:
        scores = fields.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise ModelLoadError("GGUF 'llama' tokenizer has neither merges nor one score per token")
        merges = merges_from_scores(tokens, [float(s) for s in scores], token_types)
    unk_id = _optional_id(fields, "tokenizer.ggml.unknown_token_id")
    unk_token = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    backend = tokenizers.Tokenizer(
        _bpe_model(vocab=vocab, merges=merges, unk_token=unk_token, fuse_unk=True, byte_fallback=True)
    )
    add_space_prefix = bool(fields.get("tokenizer.ggml.add_space_prefix", True))
    # split=False: SentencePiece sees the whole text as one piece with spaces written as
    # "▁", so merges may cross word boundaries exactly as the model was trained.
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_SENTENCEPIECE_SPACE, prepend_scheme="first" if add_space_prefix else "never", split=False
    )
    steps = [decoders.Replace(_SENTENCEPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        # Drop the one space the encoder put in front of the text.
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def merges_from_scores(
    tokens: Sequence[str], scores: Sequence[float], token_types: Sequence[int]
) -> list[tuple[str, str]]:
    """BPE merges implied by a scored SentencePiece vocabulary.

    SentencePiece BPE joins, at each step, the adjacent pair whose joined text is the
    best-scored token. A merge list ranked by the score of the merged token reproduces
    that. Only ordinary tokens take part: control and byte tokens never come out of a merge.
    """
    mergeable_types = (TokenType.NORMAL, TokenType.USER_DEFINED)
    index = {
        token: token_id
        for token_id, (token, token_type) in enumerate(zip(tokens, token_types))
        if token_type in mergeable_types
    }
    ranked: list[tuple[float, int, int, str, str]] = []
    for token, token_id in index.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in index and right in index:
                # Ties on score go to the lower id, then to the longer left part.
                ranked.append((-scores[token_id], token_id, -len(left), left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _add_special_tokens(backend: tokenizers.Tokenizer, tokens: Sequence[str], token_types: Sequence[int]) -> None:
    """Register control/unknown tokens as special and user-defined ones as plain added tokens.

    Added tokens are matched whole in the text before any splitting, so `<|im_start|>` in a
    prompt becomes its one id instead of being cut into pieces; they keep their ids because
    their text is already in the vocabulary.
    """
    special = []
    plain = []
    for token, token_type in zip(tokens, token_types):
        is_special = _ADDED_TOKEN_TYPES.get(token_type)
        if is_special is None or not token:
            continue
        (special if is_special else plain).append(AddedToken(token, special=is_special, normalized=False))
    if special:
        backend.add_special_tokens(special)
    if plain:
        backend.add_tokens(plain)
