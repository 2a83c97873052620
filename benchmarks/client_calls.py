"""The official clients' documented calls against a live `pagellm serve`: openai, anthropic
and ollama, each call checked for a well-formed answer.

    python benchmarks/client_calls.py                 # starts a server on the embedded model
    python benchmarks/client_calls.py --url http://127.0.0.1:8000 [--model NAME]

Prints one line per call (ok, or the error) and a summary; exits 1 when any call failed;
writes benchmarks/results/client_calls.json.
"""

from __future__ import annotations

import argparse
import io
import json
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pydantic


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    is_capital: bool


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"], "additionalProperties": False},
    },
}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def openai_calls(base_url: str, model: str) -> dict[str, Callable[[], Any]]:
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=120)
    stored: dict[str, str] = {}

    def response_then_follow_ups() -> None:
        first = client.responses.create(model=model, input="Name a colour.", max_output_tokens=8)
        assert first.output_text is not None
        stored["response"] = first.id
        follow = client.responses.create(model=model, input="Another.", previous_response_id=first.id, max_output_tokens=8)
        assert follow.previous_response_id == first.id

    def batch_round_trip() -> None:
        line = {"custom_id": "1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": model, "messages": QUESTION, "max_tokens": 4}}
        uploaded = client.files.create(file=("batch.jsonl", io.BytesIO(json.dumps(line).encode() + b"\n")), purpose="batch")
        assert client.files.retrieve(uploaded.id).id == uploaded.id and uploaded.id in {f.id for f in client.files.list()}
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
        for _ in range(240):
            batch = client.batches.retrieve(batch.id)
            if batch.status in ("completed", "failed", "cancelled", "expired"):
                break
            time.sleep(0.5)
        assert batch.status == "completed", batch.status
        assert json.loads(client.files.content(batch.output_file_id).text.splitlines()[0])["custom_id"] == "1"
        assert client.files.delete(uploaded.id).deleted

    return {
        "models.list": lambda: [m.id for m in client.models.list()],
        "models.retrieve": lambda: client.models.retrieve(model).id,
        "completions.create": lambda: client.completions.create(model=model, prompt="The sky is", max_tokens=8).choices[0].text,
        "completions.create stream": lambda: "".join(c.choices[0].text for c in client.completions.create(model=model, prompt="The sky is", max_tokens=8, stream=True)),
        "chat.completions.create": lambda: client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12).choices[0].message.content,
        "chat.completions.create stream": lambda: "".join(
            c.choices[0].delta.content or "" for c in client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, stream=True) if c.choices
        ),
        "chat.completions.create tools required": lambda: client.chat.completions.create(
            model=model, messages=QUESTION, tools=[WEATHER_TOOL], tool_choice="required", parallel_tool_calls=False, max_tokens=40
        ).choices[0].message.tool_calls[0].function.name,
        "chat.completions.parse": lambda: client.chat.completions.parse(
            model=model, messages=[{"role": "user", "content": "Describe Paris as JSON."}], response_format=City, max_tokens=60
        ).choices[0].message.parsed,
        "chat.completions.stream helper": lambda: client.chat.completions.stream(model=model, messages=QUESTION, max_tokens=8).__enter__().get_final_completion().id,
        "responses.create + previous_response_id": response_then_follow_ups,
        "responses.create stream": lambda: [e.type for e in client.responses.create(model=model, input="Hi", max_output_tokens=4, stream=True)][-1],
        "responses.retrieve": lambda: client.responses.retrieve(stored["response"]).id,
        "responses.input_items.list": lambda: [i.type for i in client.responses.input_items.list(stored["response"])],
        "responses.input_tokens.count": lambda: client.responses.input_tokens.count(model=model, input="Hello").input_tokens,
        "responses.delete": lambda: client.responses.delete(stored["response"]),
        "embeddings.create": lambda: len(client.embeddings.create(model=model, input=["hello", "world"]).data),
        "files + batches": batch_round_trip,
    }


def anthropic_calls(base_url: str, model: str) -> dict[str, Callable[[], Any]]:
    import anthropic

    claude = anthropic.Anthropic(base_url=base_url, api_key="none", max_retries=0, timeout=120)
    tool = {"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER_TOOL["function"]["parameters"]}

    def stream_helper() -> str:
        with claude.messages.stream(model=model, max_tokens=12, messages=QUESTION) as stream:
            return "".join(stream.text_stream)

    return {
        "messages.create": lambda: claude.messages.create(model=model, max_tokens=12, messages=QUESTION).content[0].text,
        "messages.create stream": lambda: [e.type for e in claude.messages.create(model=model, max_tokens=8, messages=QUESTION, stream=True)][-1],
        "messages.stream helper": stream_helper,
        "messages.create prefill": lambda: claude.messages.create(
            model=model, max_tokens=8, messages=[*QUESTION, {"role": "assistant", "content": "The capital of France is"}]
        ).content[0].text,
        "messages.create tool_choice any": lambda: claude.messages.create(
            model=model, max_tokens=40, tools=[tool], tool_choice={"type": "any"}, messages=QUESTION
        ).content[0].type,
        "messages.count_tokens": lambda: claude.messages.count_tokens(model=model, messages=QUESTION).input_tokens,
        "messages.parse": lambda: claude.messages.parse(
            model=model, max_tokens=60, messages=[{"role": "user", "content": "Describe Paris as JSON."}], output_format=City
        ).parsed_output,
    }


def ollama_calls(base_url: str, model: str) -> dict[str, Callable[[], Any]]:
    import ollama

    client = ollama.Client(host=base_url)
    return {
        "ollama list": lambda: [m.model for m in client.list().models],
        "ollama show": lambda: client.show(model).details.family,
        "ollama ps": lambda: [m.model for m in client.ps().models],
        "ollama chat": lambda: client.chat(model=model, messages=QUESTION, options={"num_predict": 12}).message.content,
        "ollama chat stream": lambda: "".join(p.message.content for p in client.chat(model=model, messages=QUESTION, options={"num_predict": 12}, stream=True)),
        "ollama generate": lambda: client.generate(model=model, prompt="Name a colour.", options={"num_predict": 8}).response,
        "ollama embed": lambda: len(client.embed(model=model, input=["hello"]).embeddings),
    }


def start_server(model: str | None) -> tuple[subprocess.Popen[str], str]:
    command = [sys.executable, "-m", "pagellm.entrypoints.cli", "serve", "--port", "0", "--max-model-len", "2048"]
    if model:
        command += ["--model", model]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None
    for line in process.stdout:
        if "pagellm is ready: model " in line:
            return process, line.split(" at ", 1)[1].split("/v1", 1)[0]
    raise RuntimeError("the server did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server (default: start one on the embedded model)")
    parser.add_argument("--model", help="the served model name (default: the server's first)")
    parser.add_argument("--output", default="benchmarks/results/client_calls.json")
    args = parser.parse_args()
    process = None
    url = args.url
    if url is None:
        process, url = start_server(None)
    try:
        import openai

        model = args.model or openai.OpenAI(base_url=url + "/v1", api_key="none").models.list().data[0].id
        results = []
        for family, calls in (("openai", openai_calls), ("anthropic", anthropic_calls), ("ollama", ollama_calls)):
            for name, call in calls(url, model).items():
                started = time.perf_counter()
                try:
                    value = call()
                    outcome = {"ok": True, "answer": repr(value)[:80]}
                except Exception as error:  # noqa: BLE001 - a failed call is this script's finding
                    outcome = {"ok": False, "error": f"{type(error).__name__}: {error}"[:300], "trace": traceback.format_exc()[-800:]}
                outcome.update(client=family, call=name, seconds=round(time.perf_counter() - started, 3))
                results.append(outcome)
                print(f"{'ok  ' if outcome['ok'] else 'FAIL'} {family:9s} {name:45s} {outcome.get('answer') or outcome.get('error')}")
    finally:
        if process is not None:
            process.send_signal(signal.SIGINT)
            process.wait(60)
    failed = [r for r in results if not r["ok"]]
    print(f"{len(results) - len(failed)} of {len(results)} calls passed")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    versions = {}
    for package in ("openai", "anthropic", "ollama"):
        try:
            from importlib.metadata import version

            versions[package] = version(package)
        except Exception:  # noqa: BLE001
            versions[package] = None
    Path(args.output).write_text(json.dumps({"benchmark": "client_calls", "clients": versions, "results": results}, indent=1))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
