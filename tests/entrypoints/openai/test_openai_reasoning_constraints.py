"""With `--reasoning-parser`, an output constraint (a response format, a required or named
tool call) holds the answer after the think block, not the block itself (vLLM's default).

On the embedded SmolLM2 a few-shot conversation makes the model think before it answers
(`<think>The sky is blue.</think>` then JSON), so the split is deterministic: the think
block is the model's own, and the answer obeys a schema the examples do not use.
(`enable_in_reasoning`, which holds the block too, is tested in test_openai_reasoning.py.)"""

from __future__ import annotations

import json
import signal

import pytest
from serve_helpers import ServerProcess

SCHEMA = {"type": "object", "properties": {"hue": {"enum": ["blue", "grey"]}}, "required": ["hue"], "additionalProperties": False}
MESSAGES = [
    {"role": "user", "content": "Colour of grass? Answer in JSON."},
    {"role": "assistant", "content": '<think>Grass is green.</think>\n\n{"colour": "green"}'},
    {"role": "user", "content": "Colour of snow? Answer in JSON."},
    {"role": "assistant", "content": '<think>Snow is white.</think>\n\n{"colour": "white"}'},
    {"role": "user", "content": "Colour of the sky? Answer in JSON."},
]
FORMAT = {"type": "json_schema", "json_schema": {"name": "hue", "schema": SCHEMA}}
TOOL = {"type": "function", "function": {"name": "paint", "parameters": SCHEMA}}


@pytest.fixture(scope="module")
def server(smollm2_path):  # noqa: ANN001, ANN201
    process = ServerProcess(["--model", str(smollm2_path), "--served-model-name", "smol", "--max-model-len", "1024",
                             "--reasoning-parser", "qwen3"])  # fmt: skip
    yield process
    assert process.stop(signal.SIGINT) == 0, process.log


def client_for(server: ServerProcess):  # noqa: ANN201
    import openai

    return openai.OpenAI(base_url=server.api_url, api_key="none", max_retries=0, timeout=120)


def test_a_response_format_holds_the_answer_after_the_think_block(server):
    with client_for(server) as client:
        free = client.chat.completions.create(model="smol", messages=MESSAGES, max_tokens=40, temperature=0)
        # Unconstrained, the model thinks and answers as the examples do.
        assert free.choices[0].message.reasoning_content == "The sky is blue."
        assert json.loads(free.choices[0].message.content) == {"colour": "blue"}
        whole = client.chat.completions.create(model="smol", messages=MESSAGES, max_tokens=40, temperature=0,
                                               response_format=FORMAT)  # fmt: skip
        message = whole.choices[0].message
        assert message.reasoning_content == "The sky is blue."  # the block was left free
        assert json.loads(message.content) == {"hue": "blue"}  # the answer obeys the schema
        chunks = list(client.chat.completions.create(model="smol", messages=MESSAGES, max_tokens=40, temperature=0,
                                                     response_format=FORMAT, stream=True))  # fmt: skip
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "The sky is blue."
    assert "".join(d.content or "" for d in deltas) == message.content


def test_required_and_named_tool_calls_come_after_the_think_block(server):
    with client_for(server) as client:
        for choice in ("required", {"type": "function", "function": {"name": "paint"}}):
            response = client.chat.completions.create(model="smol", messages=MESSAGES, max_tokens=60, temperature=0,
                                                      tools=[TOOL], tool_choice=choice, parallel_tool_calls=False)  # fmt: skip
            message = response.choices[0].message
            assert message.reasoning_content == "The sky is blue.", choice
            assert [c.function.name for c in message.tool_calls] == ["paint"], choice
            assert json.loads(message.tool_calls[0].function.arguments) in ({"hue": "blue"}, {"hue": "grey"})
            assert response.choices[0].finish_reason == "tool_calls"
        chunks = list(client.chat.completions.create(model="smol", messages=MESSAGES, max_tokens=60, temperature=0,
                                                     tools=[TOOL], tool_choice=choice, parallel_tool_calls=False,
                                                     stream=True))  # fmt: skip
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "The sky is blue."
    arguments = "".join(call.function.arguments or "" for d in deltas for call in d.tool_calls or [])
    assert arguments == message.tool_calls[0].function.arguments


def test_the_responses_text_format_holds_the_answer_after_the_reasoning(server):
    with client_for(server) as client:
        response = client.responses.create(
            model="smol", input=MESSAGES, max_output_tokens=40, temperature=0,
            text={"format": {"type": "json_schema", "name": "hue", "schema": SCHEMA}},
        )  # fmt: skip
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == "The sky is blue."
    assert json.loads(response.output_text) == {"hue": "blue"}


@pytest.mark.parametrize(
    "value,error",
    [
        ("{bad", "not JSON"),
        ('["enable_in_reasoning"]', "must be a JSON object"),
        ('{"enable_in_reasonin": true}', "unknown key(s) enable_in_reasonin"),
        ('{"enable_in_reasoning": "yes"}', "must be true or false"),
    ],
)
def test_a_bad_structured_outputs_config_is_a_clear_error(value, error, capsys):
    from pagellm.entrypoints.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--structured-outputs-config", value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--structured-outputs-config" in err and error in err, err
