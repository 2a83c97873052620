"""Tokenizer stage: the tokenizer every other stage sees (text <-> token ids, chat prompts).

`Tokenizer` wraps a `tokenizers.Tokenizer` (the Rust backend that does the real work) and
adds what the backend does not know: which ids are BOS/EOS/PAD, whether the model wants a
BOS in front of every prompt, the chat template, and the extra stop ids a model's
generation config lists. The builders in `gguf_tokenizer` and `hf_tokenizer` make one.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import tokenizers
from tokenizers import processors

from pagellm.errors import ChatTemplateError, InvalidRequestError
from pagellm.tokenizer.chat_template import render_chat_template
from pagellm.tokenizer.unicode_text import lone_surrogate, surrogate_message

logger = logging.getLogger(__name__)

# Hugging Face's `clean_up_tokenization_spaces`: spaces its old word-level tokenizers left
# before punctuation and contractions. Only HF folders that ask for it get it.
_CLEAN_UP_REPLACEMENTS = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


def clean_up_tokenization_spaces(text: str) -> str:
    for before, after in _CLEAN_UP_REPLACEMENTS:
        text = text.replace(before, after)
    return text


def bos_eos_post_processor(
    bos: tuple[str, int] | None, eos: tuple[str, int] | None
) -> processors.TemplateProcessing:
    """A post-processor that puts BOS before and/or EOS after each sequence (None = not)."""
    specials = [pair for pair in (bos, eos) if pair is not None]
    before = [bos[0]] if bos is not None else []
    after = [eos[0]] if eos is not None else []
    single = [*before, "$A", *after]
    pair = [*before, "$A", *after, *before, "$B:1", *after]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


# Longer texts are encoded by the backend's batch call, which releases the GIL (short ones
# by its single call, which holds it but costs less).
LONG_TEXT_CHARS = 16384

# Normalizers and pre-tokenizers that keep every character (_longest_token_chars).
_KEEPING_NORMALIZERS = {"Prepend", "Replace"}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Split", "Punctuation"}


def _keeps_characters(component: Mapping[str, Any] | None, keeping: set[str]) -> bool:
    if component is None:
        return True
    kind = component.get("type")
    if kind == "Sequence":
        parts = component.get("normalizers") or component.get("pretokenizers") or []
        return all(_keeps_characters(part, keeping) for part in parts)
    if kind == "Replace" and not component.get("content"):
        return False  # replacing with nothing deletes
    if kind in ("Split", "Punctuation") and component.get("behavior") == "Removed":
        return False
    return kind in keeping


def _longest_token_chars(backend: tokenizers.Tokenizer) -> int:
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or (model.get("unk_token") and model.get("fuse_unk") and not model.get("byte_fallback")):
        return 0
    if not (_keeps_characters(spec.get("normalizer"), _KEEPING_NORMALIZERS)
            and _keeps_characters(spec.get("pre_tokenizer"), _KEEPING_PRE_TOKENIZERS)):  # fmt: skip
        return 0
    return max((len(token) for token in backend.get_vocab(with_added_tokens=True)), default=0)


def _check_text(text: object) -> None:
    """The backend refuses a str with a lone surrogate as a TypeError: name it as bad input."""
    if isinstance(text, str):
        index = lone_surrogate(text)
        if index is not None:
            raise InvalidRequestError(surrogate_message("the prompt", text, index), parameter="prompt")


class Tokenizer:
    """Text <-> token ids for one model, plus its special tokens and chat template.

    `add_bos_token`/`add_eos_token`: True/False install a post-processor on `backend` that
    adds (or not) BOS/EOS when `encode(..., add_special_tokens=True)`; None keeps the
    backend's own post-processor (an HF tokenizer.json that already says what to add) and
    the flags then tell whether it puts a token in front / at the end. The Tokenizer takes
    ownership of `backend`. `vocab_size`: the number of token ids when the vocabulary has
    more than the backend holds (unreachable duplicates).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        pad_token_id: int | None = None,
        unk_token_id: int | None = None,
        add_bos_token: bool | None = False,
        add_eos_token: bool | None = False,
        chat_template: str | None = None,
        named_chat_templates: Mapping[str, str] | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        clean_up_spaces: bool = False,
        vocab_size: int | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id
        self.chat_template = chat_template
        self.named_chat_templates: Mapping[str, str] = dict(named_chat_templates or {})
        self.clean_up_spaces = clean_up_spaces
        self._longest_chars: int | None = None  # _longest_token_chars, computed on first use
        # Highest id + 1 rather than the number of entries: a vocabulary with a duplicated
        # token has a gap, and the model's embedding still has a row for it. A builder that
        # knows the full count (a GGUF token list) passes it as `vocab_size`.
        highest_id = max(backend.get_vocab(with_added_tokens=True).values(), default=-1)
        self._vocab_size = max(highest_id + 1, vocab_size or 0)
        self._check_ids()
        if add_bos_token is None and add_eos_token is None:
            self.add_bos_token, self.add_eos_token = self._probe_post_processor()
        else:
            bos, eos = self.bos_token, self.eos_token
            self.add_bos_token = bool(add_bos_token) and bos is not None
            self.add_eos_token = bool(add_eos_token) and eos is not None
            if bool(add_bos_token) != self.add_bos_token or bool(add_eos_token) != self.add_eos_token:
                logger.warning("the model asks to add BOS/EOS but names no such token; adding nothing")
            backend.post_processor = bos_eos_post_processor(
                (bos, self.bos_token_id) if self.add_bos_token and bos is not None else None,
                (eos, self.eos_token_id) if self.add_eos_token and eos is not None else None,
            )
        own_eos = {self.eos_token_id} if self.eos_token_id is not None else set()
        self.eos_token_ids: frozenset[int] = frozenset(own_eos | {int(i) for i in extra_eos_token_ids})

    # -- special tokens -------------------------------------------------------------------

    def _check_ids(self) -> None:
        size = self.vocab_size
        for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
            token_id = getattr(self, name)
            if token_id is not None and not 0 <= token_id < size:
                logger.warning("%s %d is outside the vocabulary (%d tokens); ignoring it", name, token_id, size)
                setattr(self, name, None)

    def _probe_post_processor(self) -> tuple[bool, bool]:
        """Whether the backend's post-processor puts a token before / after the text."""
        encoding = self.backend.encode("a", add_special_tokens=True)
        added = encoding.special_tokens_mask  # 1 marks a token the post-processor added
        return bool(added) and added[0] == 1, bool(added) and added[-1] == 1

    def _token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(token_id)

    @property
    def bos_token(self) -> str | None:
        return self._token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self._token(self.eos_token_id)

    @property
    def pad_token(self) -> str | None:
        return self._token(self.pad_token_id)

    @property
    def unk_token(self) -> str | None:
        return self._token(self.unk_token_id)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (the size the model's embedding must cover)."""
        return self._vocab_size

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of every special token: the added tokens marked special, BOS, EOS, UNK and PAD."""
        ids = {token_id for token_id, token in self.backend.get_added_tokens_decoder().items() if token.special}
        named = (self.bos_token_id, self.eos_token_id, self.unk_token_id, self.pad_token_id)
        ids.update(token_id for token_id in named if token_id is not None)
        return sorted(ids)

    def with_extra_eos_token_ids(self, token_ids: Iterable[int]) -> Tokenizer:
        """A copy whose `eos_token_ids` also holds `token_ids` (e.g. from generation_config.json)."""
        clone = copy.copy(self)  # the backend is shared: nothing here changes it
        clone.eos_token_ids = self.eos_token_ids | {int(i) for i in token_ids}
        return clone

    # -- text <-> ids ---------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, BOS/EOS as the model asks.

        Special tokens written in the text (like `<|im_start|>`) become their ids either way.
        A long text is encoded without holding the GIL (the backend's single `encode` holds
        it throughout: seconds for megabytes, during which no other Python thread runs).
        """
        try:
            if len(text) > LONG_TEXT_CHARS:
                return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:
            _check_text(text)
            raise

    def min_tokens(self, text: str) -> int:
        """A number of tokens `text` is sure to have at least (0 where this tokenizer can
        give no bound): lets a prompt far over the context be refused without encoding it.
        """
        longest = self._longest_token_chars()
        return -(-len(text) // longest) if longest else 0

    def _longest_token_chars(self) -> int:
        """The most characters of text one token can stand for, or 0 where that is not
        bounded. A BPE token's spelling has a character per byte (byte-level) or per
        character (SentencePiece's ▁ spelling, byte fallback's <0x..> longer still) of what
        it stands for, so no token covers more characters than its spelling has, provided
        nothing before the model removes or merges characters: a normalizer that strips or
        composes, a pre-tokenizer that removes what it splits on, or a model that fuses a
        run of unknown characters into one token."""
        if self._longest_chars is None:
            self._longest_chars = _longest_token_chars(self.backend)
        return self._longest_chars

    def encode_pair(self, first: str, second: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text pair as one sequence (a cross-encoder's input): the
        post-processor's pair template, as HF's `tokenizer(first, second)`."""
        try:
            if len(first) + len(second) > LONG_TEXT_CHARS:  # encode's comment
                return self.backend.encode_batch([(first, second)], add_special_tokens=add_special_tokens)[0].ids
            return self.backend.encode(first, second, add_special_tokens=add_special_tokens).ids
        except TypeError:
            _check_text(first)
            _check_text(second)
            raise

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        try:
            encodings = self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        except TypeError:
            for text in texts:
                _check_text(text)
            raise
        return [encoding.ids for encoding in encodings]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return clean_up_tokenization_spaces(text) if self.clean_up_spaces else text

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str | None]:
        """The vocabulary's spelling of each id (byte-level or `▁` spelling, not decoded text)."""
        return [self.backend.id_to_token(token_id) for token_id in token_ids]

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    # -- chat -----------------------------------------------------------------------------

    def _resolve_template(self, chat_template: str | None) -> str | None:
        if chat_template is None:
            return self.chat_template
        # A name picks one of the model's named templates (e.g. "tool_use"); anything else is
        # taken as the template text itself.
        return self.named_chat_templates.get(chat_template, chat_template)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        *,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        **extra: Any,
    ) -> str | list[int]:
        """The prompt for a conversation: text, or its token ids when `tokenize`.

        The template writes any BOS itself, so tokenizing adds no special tokens (as HF does).
        `extra` (tools=..., enable_thinking=...) is passed to the template.
        `continue_final_message`: the last message is left open for the model to continue
        (an assistant's prefill); add_generation_prompt must then be False.
        """
        template = self._resolve_template(chat_template)
        if template is None:
            raise ChatTemplateError(
                "this model has no chat template (none in its tokenizer metadata), so chat messages "
                "cannot be turned into a prompt; send a plain text prompt or supply a chat template"
            )
        special_tokens = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "unk_token": self.unk_token,
            "pad_token": self.pad_token,
        }
        text = render_chat_template(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            special_tokens=special_tokens,
            **extra,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, eos={self.eos_token!r}, "
            f"add_bos_token={self.add_bos_token}, chat_template={'yes' if self.chat_template else 'no'})"
        )
