"""Incremental detokenization and stop strings."""

import random

import pytest
from tiny_sentencepiece import tiny_sentencepiece_fields

from pagellm.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def smollm_tokenizer(smollm2_path):
    from pagellm.model.loader import ModelSource, load_model_config, load_tokenizer

    source = ModelSource("gguf", smollm2_path, "smollm2")
    return load_tokenizer(source, load_model_config(source))


@pytest.fixture(scope="module")
def sentencepiece_tokenizer():
    from pagellm.tokenizer import tokenizer_from_gguf_metadata

    return tokenizer_from_gguf_metadata(tiny_sentencepiece_fields())


def stream(tokenizer, token_ids, skip=True, **kwargs):
    detok = IncrementalDetokenizer(tokenizer, skip, **kwargs)
    deltas = []
    for token in token_ids:
        stop = detok.add_tokens([token])
        deltas.append(detok.take_delta(finished=False))
        if stop is not None:
            break
    detok.finish()
    deltas.append(detok.take_delta(finished=True))
    return detok, "".join(deltas)


def random_sequences(tokenizer, count, seed):
    """Random id sequences, mostly tokens whose bytes are not ASCII (split characters)."""
    rng = random.Random(seed)
    vocab = tokenizer.vocab_size
    non_ascii = [i for i in range(vocab) if any(ord(c) >= 0x80 for c in tokenizer.convert_ids_to_tokens([i])[0] or "")]
    for _ in range(count):
        yield [rng.choice(non_ascii) if rng.random() < 0.6 else rng.randrange(vocab) for _ in range(rng.randint(1, 40))]


def test_incremental_text_equals_full_decode_smollm2(smollm_tokenizer):
    for skip in (True, False):
        for ids in random_sequences(smollm_tokenizer, 2000, seed=int(skip)):
            detok, streamed = stream(smollm_tokenizer, ids, skip)
            full = smollm_tokenizer.backend.decode(ids, skip_special_tokens=skip)
            assert detok.text == full
            assert streamed == full


def test_incremental_text_equals_full_decode_sentencepiece(sentencepiece_tokenizer):
    """Byte-fallback pieces and the leading-space rule of a SentencePiece vocabulary."""
    tok = sentencepiece_tokenizer
    texts = ["hello world", " leading space", "\u00e9t\u00e9 caf\u00e9 \U0001f600", "the  tokenizer\nis"]
    for text in texts:
        ids = tok.encode(text)
        detok, streamed = stream(tok, ids)
        full = tok.backend.decode(ids, skip_special_tokens=True)
        assert detok.text == full and streamed == full
    # Arbitrary sequences (invalid byte runs included): never an error, exact final text.
    rng = random.Random(0)
    for _ in range(1000):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 30))]
        detok, _ = stream(tok, ids)
        assert detok.text == tok.backend.decode(ids, skip_special_tokens=True)


def test_multibyte_character_split_across_tokens_is_never_half_emitted(smollm_tokenizer):
    ids = smollm_tokenizer.encode("Emoji \U0001f469\u200d\U0001f467 and \u4e16\u754c")
    detok = IncrementalDetokenizer(smollm_tokenizer)
    for token in ids:
        detok.add_tokens([token])
        assert "\ufffd" not in detok.text
    detok.finish()
    assert detok.text == "Emoji \U0001f469\u200d\U0001f467 and \u4e16\u754c"


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens_is_cut(smollm_tokenizer, include):
    text = "The answer is forty-two. Goodbye and thanks"
    ids = smollm_tokenizer.encode(text)
    stop = "two. Good"
    pieces = [smollm_tokenizer.decode([i]) for i in ids]
    assert not any(stop in p for p in pieces), "the stop string must span tokens"
    detok, streamed = stream(smollm_tokenizer, ids, stop=(stop, "never"), include_stop_str_in_output=include)
    assert detok.stop_string == stop
    expected = "The answer is forty-two. Good" if include else "The answer is forty-"
    assert detok.text == expected and streamed == expected


def test_streamed_deltas_never_show_a_cut_stop_prefix(smollm_tokenizer):
    ids = smollm_tokenizer.encode("one two three four")
    detok = IncrementalDetokenizer(smollm_tokenizer, stop=(" three",))
    seen = ""
    for token in ids:
        stopped = detok.add_tokens([token])
        seen += detok.take_delta(finished=stopped is not None)
        assert " thr" not in seen
        if stopped:
            break
    assert seen == "one two"
