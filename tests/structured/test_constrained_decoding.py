"""Constrained decoding on the embedded SmolLM2: every output obeys its constraint.

A corpus of JSON schemas (nested objects, arrays with item bounds, enums, required
fields, bounded numbers, string patterns, $ref/$defs), greedy and sampled, validated
with the `jsonschema` library; regexes fullmatch; choices are one of the choices; a
GBNF arithmetic grammar is obeyed. Constrained rows never disturb unconstrained ones,
and constraints survive preemption and n > 1.
"""

import json
import re

import jsonschema
import pytest

from pagellm import LLM, SamplingParams, StructuredOutputsParams
from pagellm.errors import InvalidRequestError

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.com$"},
        },
        "required": ["name", "age", "email"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "$defs": {
            "item": {
                "type": "object",
                "properties": {"sku": {"type": "string", "maxLength": 10}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["sku", "qty"],
                "additionalProperties": False,
            }
        },
        "properties": {
            "status": {"enum": ["new", "paid", "shipped"]},
            "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 3},
            "total": {"type": "number", "minimum": 0, "maximum": 1000},
        },
        "required": ["status", "items", "total"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": -50, "maximum": 50}, "y": {"type": "integer", "minimum": -50, "maximum": 50}},
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 2, "maxItems": 2},
            "ok": {"type": "boolean"},
        },
        "required": ["point", "tags", "ok"],
        "additionalProperties": False,
    },
}
QUESTION = "Answer with a JSON object for a {}."
ARITHMETIC_GBNF = r"""
root   ::= expr
expr   ::= term (("+" | "-") term)*
term   ::= factor (("*" | "/") factor)*
factor ::= [1-9] [0-9]? | "(" expr ")"
"""
ARITHMETIC = re.compile(r"[0-9+\-*/()]+")


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(str(smollm2_path), max_model_len=1024)


def chat(llm, text):
    return llm.get_tokenizer().apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


def constrained(**kwargs):
    sampling = {k: kwargs.pop(k) for k in ("temperature", "seed", "max_tokens", "n") if k in kwargs}
    return SamplingParams(structured_outputs=StructuredOutputsParams(**kwargs), **{"max_tokens": 200, **sampling})


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_validate_greedy_and_sampled(llm, name):
    schema = SCHEMAS[name]
    params = [constrained(json=schema, temperature=0.0)] + [
        constrained(json=schema, temperature=1.0, seed=seed) for seed in range(3)
    ]
    outputs = llm.generate([chat(llm, QUESTION.format(name))] * len(params), params, use_tqdm=False)
    for output in outputs:
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), schema)


def test_json_object_regex_choice_and_grammar(llm):
    prompts = [chat(llm, "Describe a cat as JSON."), chat(llm, "A US phone number?"), chat(llm, "Is the sky blue?"), "2+2*"]
    params = [
        constrained(json_object=True, temperature=0.7, seed=1),
        constrained(regex=r"\(\d{3}\) \d{3}-\d{4}", temperature=0.9, seed=2),
        constrained(choice=["yes", "no", "it depends"], temperature=0.0),
        constrained(grammar=ARITHMETIC_GBNF, temperature=0.8, seed=3, max_tokens=24),
    ]
    json_out, phone, answer, expression = (o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False))
    assert isinstance(json.loads(json_out.text), dict)
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", phone.text), phone.text
    assert answer.text in ("yes", "no", "it depends")
    # The grammar may be cut by max_tokens: what came out is still a prefix of a sentence of it.
    assert ARITHMETIC.fullmatch(expression.text), expression.text
    if expression.finish_reason == "stop":
        assert re.fullmatch(r"[\d(][\d+\-*/()]*[\d)]", expression.text)


def test_constraints_never_leak_into_unconstrained_rows(llm):
    plain = [chat(llm, "Tell me about Paris."), "Once upon a time"]
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    alone = [o.outputs[0].token_ids for o in llm.generate(plain, greedy, use_tqdm=False)]
    mixed_prompts = [plain[0], chat(llm, QUESTION.format("person")), plain[1], chat(llm, "yes or no?")]
    mixed_params = [greedy, constrained(json=SCHEMAS["person"], temperature=0.0), greedy, constrained(choice=["yes", "no"])]
    mixed = llm.generate(mixed_prompts, mixed_params, use_tqdm=False)
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == alone
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), SCHEMAS["person"])
    assert mixed[3].outputs[0].text in ("yes", "no")


def test_constraints_survive_preemption_and_n(smollm2_path):
    # 20 usable blocks of 16 tokens for 4 chats of ~40-token prompts growing to ~200: preempted.
    llm = LLM(str(smollm2_path), max_model_len=320, num_gpu_blocks_override=21, max_num_batched_tokens=64)
    schema = SCHEMAS["order"]
    prompts = [chat(llm, QUESTION.format(f"shop order number {i}")) for i in range(4)]
    params = [constrained(json=schema, temperature=1.0, seed=i, n=2) for i in range(4)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.get_stats().num_preemptions_recompute > 0
    for output in outputs:
        assert len(output.outputs) == 2
        for completion in output.outputs:
            assert completion.finish_reason == "stop", completion.text
            jsonschema.validate(json.loads(completion.text), schema)


@pytest.mark.parametrize(
    ("constraint", "kind"),
    [
        ({"json": {"type": "object", "properties": {"a": {"type": "nosuchtype"}}}}, "json"),
        ({"regex": "(unclosed"}, "regex"),
        ({"grammar": "root ::= missing_rule"}, "grammar"),
    ],
)
def test_constraints_that_do_not_compile_are_refused_alone(llm, constraint, kind):
    with pytest.raises(InvalidRequestError) as error:
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(**constraint)), use_tqdm=False)
    assert error.value.parameter == kind and kind in str(error.value)
    # Nothing was left behind, and the engine serves on.
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_params_take_exactly_one_constraint():
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(InvalidRequestError, match="list of strings"):
        StructuredOutputsParams(choice="yes")
    # The text's spacing does not make another grammar; the order of the keys does (properties
    # are generated in the schema's order, as OpenAI's structured outputs do).
    assert StructuredOutputsParams(json={"a": 2, "b": 1}).key == StructuredOutputsParams(json='{"a":  2,\n "b": 1}').key
    assert StructuredOutputsParams(json={"b": 1, "a": 2}).key != StructuredOutputsParams(json='{"a": 2, "b": 1}').key


def test_properties_are_generated_in_the_schemas_order(smollm2_path):
    llm = LLM(str(smollm2_path), max_model_len=256)
    properties = {"zeta": {"type": "integer"}, "alpha": {"type": "string", "maxLength": 8}}
    for order in (["zeta", "alpha"], ["alpha", "zeta"]):
        schema = {"type": "object", "properties": {k: properties[k] for k in order}, "required": order, "additionalProperties": False}
        text = llm.generate(["A JSON object: "], constrained(json=schema, max_tokens=40), use_tqdm=False)[0].outputs[0].text
        assert list(json.loads(text)) == order, text


def test_metrics_count_compiles_cache_hits_and_mask_time(smollm2_path):
    from prometheus_client import generate_latest

    llm = LLM(str(smollm2_path), max_model_len=256)
    params = constrained(choice=["red", "green"], max_tokens=4)
    llm.generate(["Color:"] * 3, params, use_tqdm=False)
    llm.generate(["Color:"], params, use_tqdm=False)
    text = generate_latest(llm.engine.metrics.prom.registry).decode()

    def value(name):
        line = next(line for line in text.splitlines() if line.startswith(name))
        return float(line.rsplit(" ", 1)[1])

    assert value("pagellm:grammar_compile_seconds_count") == 1  # one distinct constraint
    assert value("pagellm:grammar_cache_hits_total") >= 3  # the other adds and the runner's lookups
    assert value("pagellm:structured_mask_seconds_count") >= 2
    assert value("pagellm:structured_mask_seconds_sum") > 0


def test_the_compiler_returns_the_same_grammar_fresh_and_cached(llm):
    compiler = llm.engine.grammars
    params = StructuredOutputsParams(regex=r"[a-z]{4}\d")
    fresh = compiler.compile(params)
    assert fresh is not None and compiler.compile(params) is fresh
    matcher = fresh.new_matcher()
    assert not matcher.is_error() and matcher is not fresh.template


def test_a_tiny_random_model_obeys_constraints_and_keeps_other_rows(tmp_path):
    """A random-weight model (byte tokenizer) writes whatever its weights say: the mask
    alone makes it valid. Unconstrained rows beside constrained ones stay as they are alone."""
    from hf_models import make_tiny_hf_checkpoint

    llm = LLM(str(make_tiny_hf_checkpoint(tmp_path, seed=6)), max_model_len=256)
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate([[10, 20, 30], [40, 50]], plain, use_tqdm=False)
    schema = {"type": "object", "properties": {"k": {"type": "integer", "minimum": 0, "maximum": 999}}, "required": ["k"],
              "additionalProperties": False}  # fmt: skip
    prompts = [[10, 20, 30], [7, 8, 9], [40, 50], [5, 5, 5], [6, 6]]
    params = [
        plain,
        constrained(regex=r"[a-c]{3}-[0-9]{2}", temperature=1.0, seed=3, max_tokens=20),
        plain,
        constrained(json=schema, temperature=1.0, seed=4, max_tokens=40),
        constrained(choice=["left", "right"], temperature=0.0, max_tokens=10),
    ]
    out = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [out[0].token_ids, out[2].token_ids] == [a.outputs[0].token_ids for a in alone]
    eos = llm.get_tokenizer().eos_token_ids
    # The byte tokenizer's EOS is byte 2, which decodes as text: compare the ids before it.
    text = lambda c: bytes(t for t in c.token_ids if t not in eos).decode()  # noqa: E731
    assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", text(out[1]))
    jsonschema.validate(json.loads(text(out[3])), schema)
    assert text(out[4]) in ("left", "right")
