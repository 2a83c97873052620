"""Loading a tokenizer from an HF checkpoint folder (tokenizer.json + tokenizer_config.json)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from pagellm.errors import ModelLoadError
from pagellm.tokenizer import tokenizer_from_hf_folder

SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Hello tokenizer, hello byte-level BPE.",
    "Caf\u00e9 na\u00efve \u00fcber \u4e2d\u6587 \U0001f600 numbers 12345 and code: def f(x): return x",
] * 20
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TEXTS = [
    "Hello world",
    "The lazy fox \u4e2d\u6587 \U0001f600!",
    "  spaced\n\ttext  ",
    "<|user|>hi</s><|assistant|>",
    "",
]


def _train_backend() -> BackendTokenizer:
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer=trainer)
    # As in Llama-style checkpoints, tokenizer.json itself puts BOS in front.
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return backend


def _write_folder(folder: Path, backend: BackendTokenizer, config: dict[str, Any] | None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


def _config(**overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        # Older configs write a special token as a serialized AddedToken.
        "bos_token": {
            "__type": "AddedToken",
            "content": "<s>",
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "special": True,
        },
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "add_bos_token": True,
        "chat_template": TEMPLATE,
    }
    config.update(overrides)
    return config


@pytest.fixture(scope="module")
def trained_backend() -> BackendTokenizer:
    return _train_backend()


@pytest.fixture()
def folder(tmp_path: Path, trained_backend: BackendTokenizer) -> Path:
    return _write_folder(tmp_path / "tok", trained_backend, _config())


def test_loads_special_tokens_and_flags(folder: Path) -> None:
    tokenizer = tokenizer_from_hf_folder(folder)
    assert tokenizer.bos_token == "<s>" and tokenizer.bos_token_id == 0
    assert tokenizer.eos_token == "</s>" and tokenizer.eos_token_id == 1
    assert tokenizer.pad_token_id == 2
    assert tokenizer.add_bos_token is True
    assert tokenizer.eos_token_ids == frozenset({1})
    assert tokenizer.chat_template == TEMPLATE
    assert set(tokenizer.all_special_ids) == {0, 1, 2, 3, 4}
    assert tokenizer.encode("Hello")[0] == 0
    assert tokenizer.encode("Hello", add_special_tokens=False)[0] != 0


def test_matches_hf(folder: Path) -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is the reference tokenizer")
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    ours = tokenizer_from_hf_folder(folder)
    assert ours.vocab_size == len(hf)
    assert ours.all_special_ids == sorted(set(ours.all_special_ids) | set(hf.all_special_ids))
    for text in TEXTS:
        for add_special_tokens in (True, False):
            ids = ours.encode(text, add_special_tokens=add_special_tokens)
            assert ids == hf.encode(text, add_special_tokens=add_special_tokens), text
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    messages = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "world"}]
    for add_generation_prompt in (True, False):
        assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == (
            hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        )


def test_tokenizer_json_post_processor_decides_bos(tmp_path: Path) -> None:
    # transformers 5 ignores tokenizer_config's add_bos_token when tokenizer.json exists;
    # the post-processor saved in tokenizer.json is what runs. pagellm does the same.
    transformers = pytest.importorskip("transformers", reason="transformers is the reference tokenizer")
    backend = _train_backend()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    folder = _write_folder(tmp_path / "tok", backend, _config(add_bos_token=True))
    tokenizer = tokenizer_from_hf_folder(folder)
    assert tokenizer.add_bos_token is False
    assert tokenizer.encode("Hello") == transformers.AutoTokenizer.from_pretrained(str(folder)).encode("Hello")
    assert tokenizer.encode("Hello")[0] != 0

    bare = _write_folder(tmp_path / "bare", _train_backend(), None)
    tokenizer = tokenizer_from_hf_folder(bare)
    assert tokenizer.add_bos_token is True  # the post-processor puts <s> in front
    assert tokenizer.encode("Hello")[0] == 0
    assert tokenizer.bos_token_id is None and tokenizer.chat_template is None


def test_named_chat_templates_use_default(tmp_path: Path, trained_backend: BackendTokenizer) -> None:
    templates = [
        {"name": "tool_use", "template": "TOOLS {{ messages | length }}"},
        {"name": "default", "template": TEMPLATE},
    ]
    folder = _write_folder(tmp_path / "tok", trained_backend, _config(chat_template=templates))
    tokenizer = tokenizer_from_hf_folder(folder)
    assert tokenizer.chat_template == TEMPLATE
    messages = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(messages, chat_template="tool_use") == "TOOLS 1"
    assert tokenizer.apply_chat_template(messages) == "<s><|user|>hi</s><|assistant|>"


def test_chat_template_jinja_file_wins(folder: Path) -> None:
    (folder / "chat_template.jinja").write_text("FILE {{ messages[0].content }}", encoding="utf-8")
    tokenizer = tokenizer_from_hf_folder(folder)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "FILE x"


def test_clean_up_tokenization_spaces(tmp_path: Path, trained_backend: BackendTokenizer) -> None:
    folder = _write_folder(tmp_path / "tok", trained_backend, _config(clean_up_tokenization_spaces=True))
    tokenizer = tokenizer_from_hf_folder(folder)
    ids = tokenizer.encode("Hello , world . It 's", add_special_tokens=False)
    assert tokenizer.decode(ids) == "Hello, world. It's"


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(_config()), encoding="utf-8")
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        tokenizer_from_hf_folder(tmp_path)


def test_corrupt_tokenizer_json(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": ', encoding="utf-8")
    with pytest.raises(ModelLoadError, match="not a valid tokenizer file"):
        tokenizer_from_hf_folder(tmp_path)


def test_corrupt_tokenizer_config(tmp_path: Path, trained_backend: BackendTokenizer) -> None:
    folder = _write_folder(tmp_path / "tok", trained_backend, None)
    (folder / "tokenizer_config.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ModelLoadError, match="not readable JSON"):
        tokenizer_from_hf_folder(folder)


def test_a_lone_surrogate_is_bad_input_not_a_type_error(folder: Path) -> None:
    from pagellm.errors import InvalidRequestError

    tokenizer = tokenizer_from_hf_folder(folder)
    for encode in (
        lambda: tokenizer.encode("ok \ud83d"),
        lambda: tokenizer.encode_pair("fine", "\udfff!"),
        lambda: tokenizer.encode_batch(["fine", "x\ud800"]),
    ):
        with pytest.raises(InvalidRequestError, match=r"lone UTF-16 surrogate \(U\+D[0-9A-F]{3}\) at character"):
            encode()
    assert tokenizer.encode("\U0001f600") == tokenizer.encode("\ud83d\ude00".encode("utf-16", "surrogatepass").decode("utf-16"))


def test_min_tokens_is_a_bound_where_the_tokenizer_keeps_every_character(tmp_path: Path, trained_backend: BackendTokenizer) -> None:
    from tokenizers import normalizers

    from pagellm.tokenizer.tokenizer import LONG_TEXT_CHARS

    tokenizer = tokenizer_from_hf_folder(_write_folder(tmp_path / "bpe", trained_backend, _config()))
    texts = [*TEXTS, " " * 5000, "=" * 300, "\U0001f600" * 100, CORPUS[2] * 50, "ab" * LONG_TEXT_CHARS]
    for text in texts:
        tokens = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.min_tokens(text) <= len(tokens), text[:40]
    assert tokenizer.min_tokens("x" * 10_000) > 0  # a real bound, not a shrug
    # The long text went through the batch call (GIL released): the same ids as the single one.
    assert tokenizer.encode("ab" * LONG_TEXT_CHARS) == trained_backend.encode("ab" * LONG_TEXT_CHARS).ids
    # A normalizer that strips, or a pre-tokenizer that drops what it splits on, can make a
    # long text few tokens: no bound there.
    for change in (
        lambda b: setattr(b, "normalizer", normalizers.Strip()),
        lambda b: setattr(b, "pre_tokenizer", pre_tokenizers.Whitespace()),
        lambda b: setattr(b, "normalizer", normalizers.Replace(" ", "")),
    ):
        backend = _train_backend()
        change(backend)
        other = tokenizer_from_hf_folder(_write_folder(tmp_path / str(id(change)), backend, _config()))
        assert other.min_tokens(" " * 10_000) == 0
