"""Embeddings (LLM.embed) against an independent reference: HF transformers' last hidden
state of the same tiny model and prompt, pooled and L2-normalised the same way, in
float32, through the scheduler's regimes: batching, chunked prefill, prefix caching,
swap and recompute preemption beside generation, and the checkpoint's own pooling
(sentence-transformers' Pooling module, GGUF pooling_type) and Matryoshka sizes."""

from __future__ import annotations

import json

import gguf
import pytest
import torch
from engine_checks import assert_engine_drained
from gguf_models import write_gguf_from_hf
from hf_models import TINY_SHAPE, load_hf_reference, make_tiny_hf_checkpoint

from pagellm import LLM, PoolingParams, SamplingParams
from pagellm.errors import InvalidRequestError

PROMPT_LENGTHS = [1, 3, 17, 40, 64, 70]  # 64: block-aligned (its last token is still computed)


def prompts(seed: int = 5) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = make_tiny_hf_checkpoint(tmp_path_factory.mktemp("embed"), "llama", seed=3)
    return folder, load_hf_reference(folder)


@torch.inference_mode()
def reference_embedding(model: torch.nn.Module, token_ids: list[int], pooling: str, normalize: bool = True) -> torch.Tensor:
    """HF's final hidden states (after the last norm) pooled as pagellm pools them."""
    hidden = model.model(torch.tensor([token_ids])).last_hidden_state[0].double()
    vector = {"last": hidden[-1], "mean": hidden.mean(dim=0), "cls": hidden[0]}[pooling]
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


def check(outputs, model, token_lists, pooling: str, normalize: bool = True, atol: float = 1e-5) -> None:  # noqa: ANN001
    assert len(outputs) == len(token_lists)
    for output, ids in zip(outputs, token_lists, strict=True):
        assert output.prompt_token_ids == ids
        expected = reference_embedding(model, ids, pooling, normalize)
        got = torch.tensor(output.outputs.embedding, dtype=torch.float64)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=atol)


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_embeddings_equal_hf_pooled_hidden_states_under_chunked_prefill(checkpoint, pooling):
    folder, model = checkpoint
    llm = LLM(str(folder), dtype="float32", max_model_len=128, max_num_batched_tokens=16)
    token_lists = prompts()
    check(llm.embed(token_lists, PoolingParams(pooling_type=pooling)), model, token_lists, pooling)
    raw = llm.embed(token_lists[:3], PoolingParams(pooling_type=pooling, normalize=False))
    check(raw, model, token_lists[:3], pooling, normalize=False, atol=1e-4)
    assert llm.get_metrics().embedding_requests == len(token_lists) + 3
    assert_engine_drained(llm)


def test_a_batch_equals_one_at_a_time_and_repeats_hit_the_prefix_cache(checkpoint):
    folder, model = checkpoint
    llm = LLM(str(folder), dtype="float32", max_model_len=128)
    token_lists = prompts(seed=9)
    together = llm.embed(token_lists)
    alone = [llm.embed([ids])[0] for ids in token_lists]
    for a, b in zip(together, alone, strict=True):
        torch.testing.assert_close(torch.tensor(a.outputs.embedding), torch.tensor(b.outputs.embedding), rtol=1e-6, atol=1e-6)
    # Run again: last-token pooling reads only the last position, so a repeated prompt's
    # full blocks come from the prefix cache, and its embedding is the same.
    again = llm.embed([token_lists[4], token_lists[5]])
    assert again[0].num_cached_tokens == 48 and again[1].num_cached_tokens == 64
    for a, b in zip(again, together[4:], strict=True):
        torch.testing.assert_close(torch.tensor(a.outputs.embedding), torch.tensor(b.outputs.embedding), rtol=1e-6, atol=1e-6)
    # Mean pooling needs every position's hidden state: no hit, the same answer.
    mean = llm.embed([token_lists[5]], PoolingParams(pooling_type="mean"))
    assert mean[0].num_cached_tokens == 0
    check(mean, model, [token_lists[5]], "mean")
    # Text inputs are tokenized as generation prompts are.
    text = llm.embed("hello embeddings")[0]
    assert text.prompt_token_ids == llm.get_tokenizer().encode("hello embeddings")
    check([text], model, [text.prompt_token_ids], "last")
    assert_engine_drained(llm)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_embeddings_beside_generation_survive_preemption(checkpoint, mode):
    """A tight cache: generation grows while mean-pooled embeddings are mid-prefill (16
    tokens a step); the latest admitted are preempted, some of them embeddings, whose
    chunks so far are kept (swap) or computed again (recompute)."""
    folder, model = checkpoint
    llm = LLM(
        str(folder), dtype="float32", max_model_len=96, num_gpu_blocks_override=13, enable_prefix_caching=False,
        preemption_mode=mode, swap_space=0.01, max_num_batched_tokens=16,
    )  # fmt: skip
    engine = llm.engine
    preempted: list[str] = []
    original = engine.scheduler._preempt

    def record(request, plan, **kwargs):  # noqa: ANN001, ANN003, ANN202
        preempted.append(request.request_id)
        return original(request, plan, **kwargs)

    engine.scheduler._preempt = record
    generator = torch.Generator().manual_seed(2)
    generation = [torch.randint(3, 256, (n,), generator=generator).tolist() for n in (40, 33, 21, 47)]
    embeddings = [torch.randint(3, 256, (n,), generator=generator).tolist() for n in (70, 58, 50)]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i, ids in enumerate(generation):
        engine.add_request(f"gen-{i}", ids, greedy)
    for i, ids in enumerate(embeddings):
        engine.add_request(f"emb-{i}", ids, PoolingParams(pooling_type="mean"))
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert any(rid.startswith("emb-") for rid in preempted), preempted
    stats = engine.get_stats()
    assert (stats.num_preemptions_swap if mode == "swap" else stats.num_preemptions_recompute) >= 1
    for i, ids in enumerate(embeddings):
        output = finished[f"emb-{i}"]
        assert output.outputs[0].token_ids == [] and output.outputs[0].finish_reason == "stop"
        expected = reference_embedding(model, ids, "mean")
        torch.testing.assert_close(torch.tensor(output.embedding, dtype=torch.float64), expected, rtol=1e-5, atol=1e-5)
    for i, ids in enumerate(generation):  # generation is undisturbed: HF's greedy tokens
        reference = model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False, min_new_tokens=40)
        assert finished[f"gen-{i}"].outputs[0].token_ids == reference[0, len(ids) :].tolist()
    assert_engine_drained(llm)


def test_the_checkpoints_pooling_and_matryoshka_sizes(tmp_path):
    """A sentence-transformers folder declaring mean pooling and Matryoshka sizes."""
    folder = make_tiny_hf_checkpoint(tmp_path / "st", "llama", seed=4)
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]))  # fmt: skip
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": TINY_SHAPE["hidden_size"], "pooling_mode_cls_token": False,
         "pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False}
    ))  # fmt: skip
    config = json.loads((folder / "config.json").read_text())
    config["matryoshka_dimensions"] = [16, 32]
    (folder / "config.json").write_text(json.dumps(config))
    model = load_hf_reference(folder)
    llm = LLM(str(folder), dtype="float32", max_model_len=128)
    token_lists = prompts(seed=13)
    check(llm.embed(token_lists), model, token_lists, "mean")  # the folder's pooling by default
    short = llm.embed(token_lists[:2], PoolingParams(dimensions=16))
    for output, ids in zip(short, token_lists[:2], strict=True):
        hidden = model.model(torch.tensor([ids])).last_hidden_state[0].double().mean(dim=0)[:16]
        expected = torch.nn.functional.normalize(hidden, dim=0)
        torch.testing.assert_close(torch.tensor(output.outputs.embedding, dtype=torch.float64), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(InvalidRequestError, match="one of the model's Matryoshka sizes"):
        llm.embed(token_lists[:1], PoolingParams(dimensions=20))
    assert_engine_drained(llm)


def test_a_model_without_matryoshka_refuses_dimensions_and_long_inputs_are_refused(checkpoint):
    folder, _ = checkpoint
    llm = LLM(str(folder), dtype="float32", max_model_len=32)
    with pytest.raises(InvalidRequestError, match="does not support Matryoshka"):
        llm.embed([[5, 6, 7]], PoolingParams(dimensions=8))
    whole = llm.embed([[5, 6, 7]], PoolingParams(dimensions=TINY_SHAPE["hidden_size"]))[0]  # its own size: a no-op
    assert whole.outputs.embedding == llm.embed([[5, 6, 7]])[0].outputs.embedding
    with pytest.raises(InvalidRequestError, match="max_model_len") as error:
        llm.embed([list(range(3, 36))])
    assert error.value.parameter == "input"
    full = llm.embed([list(range(3, 35))])[0]  # exactly max_model_len tokens: nothing is generated
    assert len(full.outputs.embedding) == TINY_SHAPE["hidden_size"]
    with pytest.raises(InvalidRequestError, match="pooling_type"):
        PoolingParams(pooling_type="max")
    assert_engine_drained(llm)


@pytest.mark.parametrize("kind,expected", [(gguf.PoolingType.MEAN, "mean"), (gguf.PoolingType.CLS, "cls"),
                                           (gguf.PoolingType.LAST, "last"), (None, "last")])  # fmt: skip
def test_a_gguf_files_pooling_type(checkpoint, tmp_path, kind, expected):
    from pagellm.model.loader import load_model_config, resolve_model_source

    folder, _ = checkpoint
    config = json.loads((folder / "config.json").read_text())
    path = write_gguf_from_hf(folder, tmp_path / "model.gguf", config, pooling_type=kind)
    assert load_model_config(resolve_model_source(str(path))).pooling_type == expected


def make_base_checkpoint(folder, causal_name: bool):  # noqa: ANN001, ANN201
    """A tiny Qwen3 base model (no LM head, untied) as transformers saves one (`layers.*`
    at the top level); `causal_name` relabels it Qwen3ForCausalLM, as Qwen3-Embedding's
    config does."""
    import transformers

    from pagellm.bench.synthetic_model import write_byte_tokenizer

    config = transformers.Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(6)
    model = transformers.Qwen3Model(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.uniform_(0.8, 1.2) if "norm" in name else param.normal_(0.0, 0.3 if "embed" in name else 0.15)
    model.save_pretrained(folder, safe_serialization=True)
    write_byte_tokenizer(folder)
    if causal_name:
        settings = json.loads((folder / "config.json").read_text())
        settings["architectures"] = ["Qwen3ForCausalLM"]
        (folder / "config.json").write_text(json.dumps(settings))
    return folder, model


@pytest.mark.parametrize("causal_name", [False, True])
def test_a_base_model_checkpoint_embeds_and_refuses_to_generate(tmp_path, causal_name):
    folder, model = make_base_checkpoint(tmp_path / "base", causal_name)
    llm = LLM(str(folder), dtype="float32", max_model_len=128, max_num_batched_tokens=32)
    assert not llm.engine.model_config.has_lm_head
    token_lists = prompts(seed=21)
    outputs = llm.embed(token_lists)
    for output, ids in zip(outputs, token_lists, strict=True):
        with torch.inference_mode():
            hidden = model(torch.tensor([ids])).last_hidden_state[0, -1].double()
        expected = torch.nn.functional.normalize(hidden, dim=0)
        torch.testing.assert_close(torch.tensor(output.outputs.embedding, dtype=torch.float64), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(InvalidRequestError, match="no LM head") as error:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    assert error.value.parameter == "model"
    assert_engine_drained(llm)
