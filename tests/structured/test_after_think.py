"""A constraint after a think block (structured/grammar_compiler.py `after_think_block`),
on the embedded SmolLM2's tokenizer, which has no think token (the tags are several tokens):
the block's text is free, the answer after it obeys the constraint, and where the grammar
says the answer starts is where the reasoning split says the content starts."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagellm.entrypoints.openai.reasoning import IN_REASONING, REASONING_FORMATS, UNDECIDED, ReasoningSplit
from pagellm.structured_outputs_params import StructuredOutputsParams, ThinkBlock

SCHEMA = {"type": "object", "properties": {"hue": {"enum": ["blue", "grey"]}}, "required": ["hue"], "additionalProperties": False}
# (constraint, answers it accepts, answers it refuses, a check of an answer)
KINDS = {
    "json": (dict(json=SCHEMA), ['{"hue": "blue"}'], ['{"colour": "blue"}', "blue"], lambda a: jsonschema.validate(json.loads(a), SCHEMA)),
    "regex": (dict(regex=r"[A-Z][a-z]+\."), ["Blue."], ["blue.", "Blue"], lambda a: re.fullmatch(r"[A-Z][a-z]+\.", a) or pytest.fail(a)),
    "choice": (dict(choice=["yes", "no"]), ["yes", "no"], ["maybe"], lambda a: a in ("yes", "no") or pytest.fail(a)),
    "grammar": (dict(grammar='root ::= "a" ("+" "a")*'), ["a+a"], ["a+", "b"], lambda a: re.fullmatch(r"a(\+a)*", a) or pytest.fail(a)),
    "json_object": (dict(json_object=True), ['{"x": 1}'], ["[1]"], lambda a: isinstance(json.loads(a), dict) or pytest.fail(a)),
}
# Think blocks the way each mode's output writes them: (block, prefix before the answer).
BLOCKS = {
    "optional": (ThinkBlock(), ["<think>free text { with } </thin k> in it</think>\n\n", "\n<think></think>", ""]),
    "required": (ThinkBlock(required=True), ["Free text, no start tag.</think>\n", "<think>With one.</think>"]),
    "opened": (ThinkBlock(opened=True), ["Inside already.</think>\n\n", "</think>"]),
}
START = {"optional": UNDECIDED, "required": UNDECIDED, "opened": IN_REASONING}
FORMAT = {"optional": REASONING_FORMATS["qwen3"], "required": REASONING_FORMATS["deepseek_r1"], "opened": REASONING_FORMATS["qwen3"]}


@pytest.fixture(scope="module")
def compiler(smollm2_path):  # noqa: ANN001, ANN201
    from pagellm.structured.grammar_compiler import GrammarCompiler
    from pagellm.tokenizer.gguf_tokenizer import tokenizer_from_gguf_file

    tokenizer = tokenizer_from_gguf_file(smollm2_path)
    return GrammarCompiler(tokenizer, 49152), tokenizer


def run(compiler, params: StructuredOutputsParams, text: str) -> tuple[bool, bool]:  # noqa: ANN001
    """(every token of `text` was allowed, the grammar may end there)."""
    grammars, tokenizer = compiler
    matcher = grammars.compile(params).new_matcher()
    consumed = matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False))
    return bool(consumed), consumed and matcher.is_accepting()


@pytest.mark.parametrize("mode", sorted(BLOCKS))
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_block_is_free_and_the_answer_is_held(compiler, mode, kind):
    fields, good, bad, check = KINDS[kind]
    block, prefixes = BLOCKS[mode]
    params = StructuredOutputsParams(**fields, after_think=block)
    split = ReasoningSplit(FORMAT[mode], START[mode])
    for prefix in prefixes:
        for answer in good:
            assert run(compiler, params, prefix + answer) == (True, True), (prefix, answer)
            # The split finds the same answer the grammar held.
            _, content = split.split(prefix + answer)
            check(content)
        for answer in bad:
            assert run(compiler, params, prefix + answer)[1] is False, (prefix, answer)


def test_an_unfinished_block_cannot_end_and_its_text_is_free(compiler):
    from pagellm.structured.token_masks import fill_masks

    grammars, tokenizer = compiler
    eos = sorted(tokenizer.eos_token_ids)[0]
    for block in (ThinkBlock(), ThinkBlock(opened=True), ThinkBlock(required=True)):
        matcher = grammars.compile(StructuredOutputsParams(json=SCHEMA, after_think=block)).new_matcher()
        assert matcher.consume_tokens(tokenizer.encode("<think>I am thinking about {", add_special_tokens=False))
        mask = fill_masks([(matcher, 0)], 1, 49152)[0]
        allowed = [(int(mask[t // 32]) >> (t % 32)) & 1 for t in range(49152)]
        assert not allowed[eos]  # the answer is still to come
        assert sum(allowed) > 0.99 * 49152  # any text (only special tokens are refused)


def test_a_json_answer_alone_is_refused_where_the_block_is_required(compiler):
    # DeepSeek-R1's output is reasoning up to the end tag: a bare answer is still reasoning.
    params = StructuredOutputsParams(json=SCHEMA, after_think=ThinkBlock(required=True))
    assert run(compiler, params, '{"hue": "blue"}') == (True, False)
    plain = StructuredOutputsParams(json=SCHEMA)
    assert run(compiler, plain, '{"hue": "blue"}') == (True, True)
    assert run(compiler, plain, '<think>x</think>{"hue": "blue"}')[0] is False


def test_the_think_block_is_part_of_the_constraint_key():
    plain = StructuredOutputsParams(json=SCHEMA)
    after = StructuredOutputsParams(json=SCHEMA, after_think=ThinkBlock())
    assert plain.key != after.key and after.key == StructuredOutputsParams(json=SCHEMA, after_think=ThinkBlock()).key
