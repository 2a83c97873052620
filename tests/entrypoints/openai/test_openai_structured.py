"""Structured outputs through the OpenAI-compatible server and the official `openai` client:
response_format (json_object, json_schema) on chat and completions, the client's `parse`
helper with a pydantic model, vLLM's structured_outputs and guided_* fields, and 400s
naming the field for constraints that cannot compile."""

import json
import re

import jsonschema
import openai
import pydantic
import pytest

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer", "minimum": 0}},
    "required": ["city", "population"],
    "additionalProperties": False,
}


class City(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    city: str
    population: int


def ask(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def test_response_format_json_schema_on_chat(smol):
    response = smol.chat.completions.create(
        model="smol", messages=ask("Give a city and its population."), max_tokens=80,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}},
    )  # fmt: skip
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_the_clients_parse_helper_with_a_pydantic_model(smol):
    completion = smol.chat.completions.parse(
        model="smol", messages=ask("Name a city and its population."), max_tokens=80, response_format=City
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, City)


def test_json_object_streaming_and_completions_endpoint(smol):
    chunks = smol.chat.completions.create(
        model="smol", messages=ask("Describe a dog in JSON."), max_tokens=120, temperature=0.8, seed=4,
        response_format={"type": "json_object"}, stream=True,
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(json.loads(text), dict)
    completion = smol.completions.create(
        model="smol", prompt="The capital of France, as JSON:", max_tokens=80,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}},
    )  # fmt: skip
    jsonschema.validate(json.loads(completion.choices[0].text), SCHEMA)


def test_vllm_fields(smol):
    choice = smol.chat.completions.create(
        model="smol", messages=ask("Is water wet?"), max_tokens=5, extra_body={"guided_choice": ["yes", "no"]}
    ).choices[0]
    assert choice.message.content in ("yes", "no")
    regex = smol.completions.create(
        model="smol", prompt="Date:", max_tokens=20, temperature=0.9, seed=1,
        extra_body={"structured_outputs": {"regex": r"20\d\d-\d\d-\d\d"}},
    ).choices[0].text  # fmt: skip
    assert re.fullmatch(r"20\d\d-\d\d-\d\d", regex)
    grammar = smol.completions.create(
        model="smol", prompt="1+", max_tokens=12, extra_body={"guided_grammar": 'root ::= [1-9] ("+" [1-9])*'}
    ).choices[0]
    # Cut by max_tokens (the grammar has no end the model must reach), or whole.
    ending = r"\+?" if grammar.finish_reason == "length" else ""
    assert re.fullmatch(r"[1-9](\+[1-9])*" + ending, grammar.text), grammar


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nosuch"}}}}, "response_format"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs"),
        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),
        ({"structured_outputs": {"json": {"type": "object"}, "regex": "a"}}, "structured_outputs"),
    ],
)
def test_bad_constraints_are_400s_naming_the_field(smol, extra, field):
    with pytest.raises(openai.BadRequestError) as error:
        smol.chat.completions.create(model="smol", messages=ask("hi"), max_tokens=5, extra_body=extra)
    assert error.value.status_code == 400
    assert error.value.body["param"] == field and field in error.value.body["message"], error.value.body
    # The server serves on.
    assert smol.chat.completions.create(model="smol", messages=ask("hi"), max_tokens=2).choices[0].message.content is not None


def test_an_empty_regex_or_grammar_is_refused_as_the_schema_says():
    import pydantic

    from pagellm.entrypoints.openai.protocol import StructuredOutputsFields

    schema = StructuredOutputsFields.model_json_schema(by_alias=True)["properties"]
    for field in ("regex", "grammar"):
        assert {"type": "string", "minLength": 1} in schema[field]["anyOf"]
        with pytest.raises(pydantic.ValidationError):
            StructuredOutputsFields.model_validate({field: ""})
