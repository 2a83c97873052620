"""The reasoning split (entrypoints/openai/reasoning.py): whole outputs, and every way of
cutting them into streamed deltas, which must add up to the same split with no tag
leaking into either part."""

from __future__ import annotations

import random

import pytest

from pagellm.entrypoints.openai.reasoning import REASONING_FORMATS, StreamingReasoning, split_reasoning

QWEN3, R1 = REASONING_FORMATS["qwen3"], REASONING_FORMATS["deepseek_r1"]

CASES = [
    # (format, output, reasoning, content)
    (QWEN3, "<think>\nLet me add: 2 + 2 = 4.\n</think>\n\nThe answer is 4.", "\nLet me add: 2 + 2 = 4.\n", "The answer is 4."),
    (QWEN3, "The answer is 4.", None, "The answer is 4."),  # thinking turned off: no tags
    (QWEN3, "<think>\nStill thinking when max_tokens cut it", "\nStill thinking when max_tokens cut it", None),
    (QWEN3, "<think></think>Short.", "", "Short."),
    (QWEN3, "  <think>a < b and c </thin k> d</think>e", "a < b and c </thin k> d", "e"),  # near-tags are text
    (QWEN3, "x <think> y", None, "x <think> y"),  # a tag after the start is content
    (R1, "Okay, so 2 + 2.\n</think>\n\n4", "Okay, so 2 + 2.\n", "4"),  # the template opened the tag
    (R1, "<think>Again opened.</think>4", "Again opened.", "4"),
    (R1, "Thinking with no end", "Thinking with no end", None),
    (QWEN3, "<thi", None, "<thi"),  # a partial tag that never completes is text
    (R1, "a </thi", "a </thi", None),
]


def stream(fmt, pieces, expected):  # noqa: ANN001, ANN201
    """Feed the pieces; after each, what was emitted must be a prefix of the final split
    (nothing is taken back: no tag, whole or cut, ever reaches either part)."""
    parser = StreamingReasoning(fmt)
    reasoning, content = "", ""
    for piece in pieces:
        r, c = parser.feed(piece)
        reasoning, content = reasoning + r, content + c
        assert expected[0].startswith(reasoning) and expected[1].startswith(content), (pieces, reasoning, content)
    r, c = parser.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize("fmt,text,reasoning,content", CASES)
def test_a_whole_output_splits_into_reasoning_and_content(fmt, text, reasoning, content):
    assert split_reasoning(text, fmt) == (reasoning, content)


@pytest.mark.parametrize("fmt,text,reasoning,content", CASES)
def test_every_two_way_cut_streams_to_the_same_split(fmt, text, reasoning, content):
    for cut in range(len(text) + 1):
        expected = (reasoning or "", content or "")
        assert stream(fmt, [text[:cut], text[cut:]], expected) == expected, cut


@pytest.mark.parametrize("fmt,text,reasoning,content", CASES)
def test_one_character_at_a_time_and_random_cuts(fmt, text, reasoning, content):
    expected = (reasoning or "", content or "")
    assert stream(fmt, list(text), expected) == expected
    rng = random.Random(7)
    for _ in range(50):
        cuts = sorted(rng.sample(range(len(text) + 1), min(4, len(text) + 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert stream(fmt, pieces, expected) == expected


def test_nothing_is_emitted_while_a_tag_may_still_be_forming():
    parser = StreamingReasoning(QWEN3)
    assert parser.feed("<th") == ("", "")
    assert parser.feed("ink>abc</th") == ("abc", "")
    assert parser.feed("ink>\n") == ("", "")  # the newlines after the end tag are not content
    assert parser.feed("\nDone") == ("", "Done")
    assert parser.finish() == ("", "")
