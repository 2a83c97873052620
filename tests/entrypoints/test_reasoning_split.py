"""The reasoning split (entrypoints/openai/reasoning.py): whole outputs, and every way of
cutting them into streamed deltas, which must add up to the same split with no tag
leaking into either part."""

from __future__ import annotations

import random

import pytest

from pagellm.entrypoints.openai.reasoning import (
    IN_CONTENT,
    IN_REASONING,
    REASONING_FORMATS,
    ReasoningSplit,
    StreamingReasoning,
    split_reasoning,
)
from pagellm.structured_outputs_params import ThinkBlock

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


@pytest.mark.parametrize(
    "prompt,start",
    [
        ("<|im_start|>assistant\n", "undecided"),  # the output decides (Qwen3 with thinking on)
        ("<|im_start|>assistant\n<think>\n", "reasoning"),  # the template opened the block
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "content"),  # an empty block: thinking off
        # An earlier turn's block says nothing about this one.
        ("<think>a</think>b<|im_end|>\n<|im_start|>assistant\n", "undecided"),
        ("user wrote </think>", "undecided"),  # an end tag with no block
    ],
)
def test_where_the_prompt_leaves_the_output(prompt, start):
    assert ReasoningSplit.for_prompt(QWEN3, prompt).start == start


def test_an_output_that_starts_inside_or_after_the_block():
    inside = ReasoningSplit(QWEN3, IN_REASONING)
    assert inside.split("so 2 + 2 = 4.</think>\n\n4") == ("so 2 + 2 = 4.", "4")
    assert inside.split("<think> is text here</think>4") == ("<think> is text here", "4")
    assert inside.split("cut short") == ("cut short", None)
    assert inside.split("") == ("", None)  # the block was open: an empty reasoning part
    after = ReasoningSplit(QWEN3, IN_CONTENT)
    assert after.split("<think>not a block</think>4") == (None, "<think>not a block</think>4")
    for cut in range(1, 12):
        text = "so 4.</think>\n\n4"
        assert stream_split(inside, [text[:cut], text[cut:]]) == ("so 4.", "4")


def stream_split(split, pieces):  # noqa: ANN001, ANN201
    parser = split.streaming()
    reasoning, content = "", ""
    for piece in [*pieces, None]:
        r, c = parser.feed(piece) if piece is not None else parser.finish()
        reasoning, content = reasoning + r, content + c
    return reasoning, content


def test_the_think_block_a_constraint_leaves_free():
    assert ReasoningSplit(QWEN3, IN_CONTENT).think_block() is None  # all answer: constrained from the start
    assert ReasoningSplit(QWEN3, IN_REASONING).think_block() == ThinkBlock(opened=True)
    assert ReasoningSplit(QWEN3).think_block() == ThinkBlock()  # optional
    assert ReasoningSplit(R1).think_block() == ThinkBlock(required=True)
