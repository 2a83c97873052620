"""LoRA adapters on the server, through the official openai client: --lora-modules at start,
load and unload while serving, adapters in /v1/models, a request's `model` selecting one
(answers equal to the offline API's under the same adapter), and the errors."""

from __future__ import annotations

import httpx2
import pytest
from hf_models import make_tiny_hf_checkpoint
from peft_adapters import ATTENTION, MLP, make_peft_adapter
from serve_helpers import API_KEY, ServerProcess

from pagellm import LLM, LoRARequest, SamplingParams

openai = pytest.importorskip("openai")
pytest.importorskip("peft")
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("served-lora")
    base = make_tiny_hf_checkpoint(root / "base", "llama")
    return {
        "base": base,
        "sql": make_peft_adapter(base, root / "sql", 8, ATTENTION + MLP, seed=1),
        "chat": make_peft_adapter(base, root / "chat", 4, ["q_proj", "v_proj"], seed=2),
    }


@pytest.fixture(scope="module")
def server(files):
    args = ["--model", str(files["base"]), "--served-model-name", "base", "--enable-lora", "--max-loras", "2",
            "--lora-modules", f"sql={files['sql']}"]  # fmt: skip
    process = ServerProcess(args, api_key=API_KEY)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY)


@pytest.fixture(scope="module")
def offline(files):
    llm = LLM(str(files["base"]), enable_lora=True, max_loras=2)

    def text(adapter: str | None) -> str:
        lora = None if adapter is None else LoRARequest(adapter, 1 if adapter == "sql" else 2, str(files[adapter]))
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        return llm.generate([PROMPT], params, lora_request=lora, use_tqdm=False)[0].outputs[0].text

    return text


def _completion_tokens(client, model: str) -> str:
    result = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert result.model == model
    return result.choices[0].text


def _post(server, path: str, body: dict, key: str | None = API_KEY) -> httpx2.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx2.post(server.base_url + path, json=body, headers=headers, timeout=60)


def test_an_adapter_named_at_start_answers_as_offline(client, offline):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"base", "sql"} and models["sql"].model_extra["parent"] == "base"
    assert _completion_tokens(client, "sql") == offline("sql")
    assert _completion_tokens(client, "base") == offline(None)
    assert offline("sql") != offline(None)
    chat = client.chat.completions.create(model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert chat.model == "sql"


def test_every_api_answers_under_the_adapters_name(server, client):
    """Messages and Responses, whole and streamed, name the adapter that answered."""
    message = {"model": "sql", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    assert _post(server, "/v1/messages", message).json()["model"] == "sql"
    streamed = _post(server, "/v1/messages", {**message, "stream": True}).text
    assert '"model": "sql"' in streamed and '"model": "base"' not in streamed
    response = {"model": "sql", "input": "hi", "max_output_tokens": 3}
    assert _post(server, "/v1/responses", response).json()["model"] == "sql"
    events = [e for e in client.responses.create(model="sql", input="hi", max_output_tokens=3, stream=True) if hasattr(e, "response")]
    assert events and all(e.response.model == "sql" for e in events)


def test_metrics_count_requests_per_adapter_and_slot_traffic(server, client):
    import re

    _completion_tokens(client, "sql")
    text = httpx2.get(server.base_url + "/metrics", timeout=10).text

    def value(pattern: str) -> float:
        match = re.search(pattern + r" ([0-9.e+]+)", text)
        assert match is not None, pattern
        return float(match.group(1))

    assert value(r'pagellm:lora_adapter_loads_total\{model_name="base"\}') >= 1
    assert value(r'pagellm:lora_adapter_evictions_total\{model_name="base"\}') >= 0
    assert "# TYPE pagellm:lora_requests_running gauge" in text and "# TYPE pagellm:lora_requests_waiting gauge" in text
    state = httpx2.get(server.base_url + "/v1/engine/state", timeout=10).json()
    assert all("adapter" in request for request in state["requests"])


def test_load_use_and_unload_while_serving(server, client, files, offline):
    assert _post(server, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": str(files["chat"])}).status_code == 200
    assert "chat" in {m.id for m in client.models.list().data}
    assert _completion_tokens(client, "chat") == offline("chat")
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "chat"}).status_code == 200
    with pytest.raises(openai.NotFoundError, match="`chat` does not exist"):
        client.completions.create(model="chat", prompt="x", max_tokens=2)
    assert "chat" not in {m.id for m in client.models.list().data}
    # Loaded again (a new id): answers as before.
    assert _post(server, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": str(files["chat"])}).status_code == 200
    assert _completion_tokens(client, "chat") == offline("chat")
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "chat"}).status_code == 200


def test_errors_are_named(server, files, tmp_path):
    cases = [
        ({"lora_name": "x", "lora_path": str(tmp_path / "missing")}, 400, "lora_path", "is not a folder"),
        ({"lora_name": "sql", "lora_path": str(files["sql"])}, 400, "lora_name", "already loaded"),
        ({"lora_name": "base", "lora_path": str(files["sql"])}, 400, "lora_name", "base model"),
        ({"lora_name": "x"}, 400, None, None),
    ]
    for body, status, param, message in cases:
        response = _post(server, "/v1/load_lora_adapter", body)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        if param is not None:
            assert error["param"] == param and message in error["message"], error
    unknown = _post(server, "/v1/unload_lora_adapter", {"lora_name": "nope"})
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "lora_name"
    assert _post(server, "/v1/load_lora_adapter", {"lora_name": "y", "lora_path": "."}, key=None).status_code == 401


def test_a_server_without_enable_lora_refuses_adapters(files):
    process = ServerProcess(["--model", str(files["base"])])
    try:
        response = _post(process, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": str(files["sql"])}, key=None)
        assert response.status_code == 400 and "--enable-lora" in response.json()["error"]["message"]
    finally:
        process.stop()


def test_a_prompt_under_another_adapter_is_a_cache_miss_by_model(client):
    """The same prompt under the base model, then under an adapter: its blocks are the
    adapter's own, so the diagnosis names the model change."""
    messages = [{"role": "user", "content": "same prompt " * 8}]  # whole blocks to share
    base = client.chat.completions.create(model="base", messages=messages, max_tokens=1)
    under_adapter = client.chat.completions.create(
        model="sql", messages=messages, max_tokens=1, extra_body={"prompt_cache_options": {"comparison_id": base.id}}
    )
    diagnosis = under_adapter.model_extra["prompt_cache_diagnostics"]
    assert diagnosis["type"] == "cache_miss" and diagnosis["reason"] == "model_changed"
    assert diagnosis["cache_missed_tokens"] == diagnosis["comparison_reusable_tokens"] > 0
    assert diagnosis["first_divergent_token"] is None  # the same tokens: the adapter alone made the difference
