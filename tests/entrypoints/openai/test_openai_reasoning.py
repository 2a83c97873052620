"""`pagellm serve --reasoning-parser qwen3` on the embedded SmolLM2, whose tokenizer has no
think token: the tags arrive as several tokens each. An output constraint, which with
`--structured-outputs-config '{"enable_in_reasoning": true}'` applies from the first output
token, makes the model write a think block, so the split is deterministic. Chat (whole and
streamed), the Responses API and Anthropic's Messages API all carry it. (By default a
constraint holds the answer after the block: test_openai_reasoning_constraints.py.)"""

from __future__ import annotations

import json
import re
import signal

import httpx2
import pytest
from serve_helpers import ServerProcess
from test_openai_reasoning_constraints import FORMAT
from test_openai_reasoning_constraints import MESSAGES as FEW_SHOT

THINKING = r"<think>[a-z ]{8,40}</think>\n\n[A-Z][a-z ]{4,30}\."
PATTERN = re.compile(r"<think>([a-z ]{8,40})</think>\n\n([A-Z][a-z ]{4,30}\.)")


@pytest.fixture(scope="module")
def thinking_server(smollm2_path):  # noqa: ANN001, ANN201
    process = ServerProcess(["--model", str(smollm2_path), "--served-model-name", "smol", "--max-model-len", "1024",
                             "--reasoning-parser", "qwen3",
                             "--structured-outputs-config", '{"enable_in_reasoning": true}'])  # fmt: skip
    yield process
    assert process.stop(signal.SIGINT) == 0, process.log


def completion_text(server: ServerProcess) -> str:
    """The raw output, through /v1/completions (no parser there) on the same chat prompt."""
    tokens = httpx2.post(server.base_url + "/tokenize", json={"messages": MESSAGES}, timeout=60).json()["tokens"]
    body = {"prompt": tokens, "max_tokens": 80, "temperature": 0, "structured_outputs": {"regex": THINKING}}
    return httpx2.post(server.api_url + "/completions", json=body, timeout=120).json()["choices"][0]["text"]


MESSAGES = [{"role": "user", "content": "Think, then answer: what colour is the sky?"}]


def test_chat_splits_reasoning_whole_and_streamed(thinking_server):
    import openai

    raw = completion_text(thinking_server)
    match = PATTERN.fullmatch(raw)
    assert match, raw
    with openai.OpenAI(base_url=thinking_server.api_url, api_key="none", max_retries=0, timeout=120) as client:
        extra = {"structured_outputs": {"regex": THINKING}}
        whole = client.chat.completions.create(model="smol", messages=MESSAGES, max_tokens=80, temperature=0, extra_body=extra)
        message = whole.choices[0].message
        assert message.reasoning_content == match.group(1) and message.content == match.group(2)
        chunks = list(client.chat.completions.create(model="smol", messages=MESSAGES, max_tokens=80, temperature=0,
                                                     extra_body=extra, stream=True))  # fmt: skip
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert reasoning == match.group(1) and content == match.group(2)
    # Reasoning comes first: no reasoning delta after the first content.
    first_content = next(i for i, d in enumerate(deltas) if d.content)
    assert not any(getattr(d, "reasoning_content", None) for d in deltas[first_content:])
    assert "<think" not in reasoning + content and "</think" not in reasoning + content


def test_responses_and_messages_carry_the_reasoning(thinking_server):
    import anthropic
    import openai

    match = PATTERN.fullmatch(completion_text(thinking_server))
    assert match
    with openai.OpenAI(base_url=thinking_server.api_url, api_key="none", max_retries=0, timeout=120) as client:
        response = client.responses.create(
            model="smol", input=MESSAGES[0]["content"], max_output_tokens=80, temperature=0,
            extra_body={"structured_outputs": {"regex": THINKING}},
        )  # fmt: skip
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message"]
    assert response.output[0].content[0].text == match.group(1) and response.output_text == match.group(2)
    extra = {"temperature": 0, "structured_outputs": {"regex": THINKING}}
    with anthropic.Anthropic(base_url=thinking_server.base_url, api_key="none", max_retries=0, timeout=120) as claude:
        message = claude.messages.create(model="smol", max_tokens=80, messages=MESSAGES, extra_body=extra)
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == match.group(1) and message.content[1].text == match.group(2)


def test_chat_template_kwargs_reach_the_template(tmp_path):
    from hf_models import make_tiny_hf_checkpoint

    from pagellm.entrypoints.openai.protocol import ChatCompletionRequest
    from pagellm.entrypoints.openai.serving_chat import chat_prompt_text
    from pagellm.model.loader import load_model_config, load_tokenizer, resolve_model_source

    folder = make_tiny_hf_checkpoint(tmp_path / "tiny", "llama")
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings["chat_template"] = (
        "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}[no think]{% endif %}"
        "{% if add_generation_prompt %}>{% endif %}"
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    source = resolve_model_source(str(folder))
    tokenizer = load_tokenizer(source, load_model_config(source))

    def prompt(**kwargs: object) -> str:
        request = ChatCompletionRequest.model_validate({"messages": MESSAGES, **kwargs})
        return chat_prompt_text(tokenizer, request.messages, request)

    assert prompt().endswith("sky?\n>")
    # The template sees the request's variables; the server keeps opening the assistant's turn.
    assert prompt(chat_template_kwargs={"enable_thinking": False, "add_generation_prompt": False}).endswith("[no think]>")


def test_enable_in_reasoning_holds_the_output_from_its_first_token(thinking_server):
    import openai

    with openai.OpenAI(base_url=thinking_server.api_url, api_key="none", max_retries=0, timeout=120) as client:
        response = client.chat.completions.create(model="smol", messages=FEW_SHOT, max_tokens=40, temperature=0,
                                                  response_format=FORMAT)  # fmt: skip
    message = response.choices[0].message
    # The few-shot examples think first, but the schema, from the first token, left no room.
    assert getattr(message, "reasoning_content", None) is None
    assert json.loads(message.content) == {"hue": "blue"}
