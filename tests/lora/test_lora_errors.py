"""Adapters that cannot be served are refused when a request first names them, with the
file and the problem in the message; the engine goes on serving the others."""

from __future__ import annotations

import json
import shutil

import pytest
from hf_models import make_tiny_hf_checkpoint
from peft_adapters import make_peft_adapter

from pagellm import LLM, LoRARequest, SamplingParams
from pagellm.errors import InvalidRequestError

pytest.importorskip("peft")
PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-errors")
    base = make_tiny_hf_checkpoint(root / "base", "llama")
    good = make_peft_adapter(base, root / "good", 8, ["q_proj", "v_proj"], seed=1)
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=8)
    return root, base, good, llm


def _variant(root, good, name, edit) -> str:
    folder = root / name
    if not folder.exists():
        shutil.copytree(good, folder)
        edit(folder)
    return str(folder)


def _refused(llm, request, match):
    with pytest.raises(InvalidRequestError, match=match) as info:
        llm.generate([[1, 2, 3]], PARAMS, lora_request=request, use_tqdm=False)
    assert info.value.parameter in ("lora_path", "lora_request")
    assert not llm.engine.has_unfinished_requests()


def test_bad_adapters_are_named(setup, tmp_path):
    root, base, good, llm = setup

    def set_config(**changes):
        def edit(folder):
            config = json.loads((folder / "adapter_config.json").read_text())
            config.update(changes)
            (folder / "adapter_config.json").write_text(json.dumps(config))
        return edit

    cases = [
        (str(root / "missing"), "is not a folder"),
        (_variant(root, good, "no-config", lambda f: (f / "adapter_config.json").unlink()), "has no adapter_config.json"),
        (_variant(root, good, "no-weights", lambda f: (f / "adapter_model.safetensors").unlink()), "has no adapter_model.safetensors"),
        (_variant(root, good, "corrupt", lambda f: (f / "adapter_model.safetensors").write_bytes(b"\x10\x00garbage")), "not a readable safetensors"),
        (_variant(root, good, "bad-json", lambda f: (f / "adapter_config.json").write_text("{")), "not readable JSON"),
        (_variant(root, good, "dora", set_config(use_dora=True)), "DoRA is not supported"),
        (_variant(root, good, "saved-modules", set_config(modules_to_save=["lm_head"])), "modules_to_save"),
    ]  # fmt: skip
    for i, (path, match) in enumerate(cases):
        _refused(llm, LoRARequest(f"bad{i}", 100 + i, path), match)
    too_big = make_peft_adapter(base, root / "r16", 16, ["q_proj"], seed=2)
    _refused(llm, LoRARequest("big", 200, str(too_big)), "rank 16 of .*q_proj is above --max-lora-rank 8")
    head = make_peft_adapter(base, root / "head", 4, ["lm_head"], seed=3)
    _refused(llm, LoRARequest("head", 201, str(head)), "lm_head is not a layer LoRA can adapt")
    # The good adapter still runs, and its id stays its own.
    out = llm.generate([[1, 2, 3]], PARAMS, lora_request=LoRARequest("good", 1, str(good)), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    _refused(llm, LoRARequest("other", 1, str(too_big)), "lora_int_id 1 is already the adapter at")


def test_an_adapter_without_enable_lora_and_bad_requests(setup):
    root, base, good, _ = setup
    plain = LLM(str(base), dtype="float32")
    _refused(plain, LoRARequest("good", 1, str(good)), "without enable_lora")
    with pytest.raises(InvalidRequestError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("zero", 0, str(good))
    with pytest.raises(InvalidRequestError, match="2 LoRA requests for 1 prompts"):
        plain.generate([[1, 2]], PARAMS, lora_request=[None, None], use_tqdm=False)


def test_a_gguf_file_that_is_not_a_lora_is_named(setup, tmp_path):
    import json

    from gguf_models import write_gguf_from_hf

    root, base, good, llm = setup
    model_file = write_gguf_from_hf(base, tmp_path / "model.gguf", json.loads((base / "config.json").read_text()), quant_by_kind={})
    _refused(llm, LoRARequest("model", 300, str(model_file)), "not a LoRA adapter")
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(model_file.read_bytes()[:200])
    _refused(llm, LoRARequest("cut", 301, str(truncated)), "not a readable GGUF file")
