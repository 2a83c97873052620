"""GGUF loading: config, dequantization of every supported type, q/k layout, errors."""

import json

import gguf
import numpy as np
import pytest
import torch
from gguf_models import write_gguf_from_hf
from hf_models import make_tiny_hf_checkpoint
from reference import pagellm_greedy

from pagellm import LLM
from pagellm.errors import ModelLoadError, UnsupportedModelError
from pagellm.model.loader import ModelSource, load_model_config
from pagellm.model.checkpoint.gguf_metadata import dequantize_tensor
from pagellm.model.checkpoint.gguf_reader import open_gguf

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [3, 4], [99, 100, 101]]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    folder = make_tiny_hf_checkpoint(root / "hf", "llama")
    cfg = json.loads((folder / "config.json").read_text())
    return write_gguf_from_hf(folder, root / "tiny.gguf", cfg)


def test_config_from_metadata(tiny_gguf):
    config = load_model_config(ModelSource("gguf", tiny_gguf, "tiny"))
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (2, 64, 128)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    assert config.rope_theta == 10000.0 and config.max_position_embeddings == 512
    assert config.tie_word_embeddings is False
    assert config.eos_token_ids == (2,)


def test_mixed_type_gguf_matches_transformers(tiny_gguf):
    """Q8_0/Q4_0/Q4_1/F16/BF16/F32 tensors, permuted q/k: same logits and tokens as HF."""
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32
    ).eval()
    for prompt, tokens in zip(PROMPTS, pagellm_greedy(LLM(str(tiny_gguf)), PROMPTS, 32)):
        expected = ref.generate(
            torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0
        )[0, len(prompt) :].tolist()
        assert tokens == expected


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "F16", "BF16"])
def test_dequantization_matches_an_independent_implementation(tmp_path, qtype):
    """Random (valid) blocks of each type, dequantized by us and by transformers' own code."""
    dequant = pytest.importorskip("transformers.integrations.gguf.dequant")
    kind = gguf.GGMLQuantizationType[qtype]
    block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
    rows, cols = 3, 512
    rng = np.random.default_rng(0)
    float_types = {"F16": torch.float16, "BF16": torch.bfloat16}
    if qtype in float_types:
        values = rng.standard_normal((rows, cols)).astype(np.float32)
        raw = gguf.quants.quantize(values, kind)
    else:
        raw = rng.integers(0, 256, size=(rows, cols // block_size, type_size), dtype=np.uint8)
        # The leading fp16 scale(s) of each block: keep them finite and modest.
        scales = rng.uniform(-0.05, 0.05, size=(rows, cols // block_size, 2)).astype(np.float16)
        head = 4 if kind in (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q4_1) else 2
        if kind == gguf.GGMLQuantizationType.Q6_K:
            raw[..., -2:] = scales[..., :1].view(np.uint8)  # Q6_K keeps its scale last
        else:
            raw[..., :head] = scales[..., : head // 2].view(np.uint8).reshape(rows, -1, head)
        raw = raw.reshape(rows, -1)
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("w", raw, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = open_gguf(path).tensors[0]
    ours = dequantize_tensor(tensor)
    assert ours.shape == (rows, cols)
    if qtype in float_types:  # reference: torch's own rounding to the 16-bit type
        reference = torch.from_numpy(values).to(float_types[qtype]).float()
    else:
        reference = dequant.dequantize(
            torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(-1)), int(kind)
        ).reshape(rows, cols)
    np.testing.assert_allclose(ours, reference.numpy(), rtol=1e-6, atol=1e-6)
    assert np.isfinite(ours).all() and np.abs(ours).max() > 0


def test_corrupt_and_unsupported_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF but not really" * 10)
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        load_model_config(ModelSource("gguf", bad, "bad"))
    other = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(other), "gpt2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="'gpt2'.*llama"):
        load_model_config(ModelSource("gguf", other, "gpt2"))


def _metadata_only_gguf(path, overrides: dict, dropped: tuple[str, ...] = ()):
    """A llama GGUF with the model metadata only (values typed as given) and an embedding."""
    values = {
        "llama.block_count": 2, "llama.context_length": 512, "llama.embedding_length": 64,
        "llama.feed_forward_length": 128, "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2,
        "llama.rope.freq_base": 10000.0, "llama.attention.layer_norm_rms_epsilon": 1e-5,
    }  # fmt: skip
    values.update(overrides)
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in values.items():
        if key in dropped:
            continue
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    writer.add_tensor("token_embd.weight", np.zeros((256, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return ModelSource("gguf", path, "meta")


def test_bad_metadata_is_an_error_naming_its_key_not_a_silent_default(tmp_path, caplog):
    cases = [
        ({"llama.rope.freq_base": "ten thousand"}, "llama.rope.freq_base in .* is 'ten thousand', not a number"),
        ({"llama.attention.head_count_kv": "2"}, "llama.attention.head_count_kv in .* is '2', not an integer"),
        ({"llama.attention.head_count_kv": 3}, "4 attention heads do not split into 3 KV heads"),
        ({"llama.embedding_length": 0}, "llama.embedding_length in .* is 0, not an integer >= 1"),
        ({"llama.attention.layer_norm_rms_epsilon": "tiny"}, "llama.attention.layer_norm_rms_epsilon"),
    ]
    for index, (overrides, message) in enumerate(cases):
        with pytest.raises(ModelLoadError, match=message):
            load_model_config(_metadata_only_gguf(tmp_path / f"bad{index}.gguf", overrides))
    with pytest.raises(ModelLoadError, match="lacks metadata key llama.block_count"):
        load_model_config(_metadata_only_gguf(tmp_path / "no_layers.gguf", {}, dropped=("llama.block_count",)))
    # Keys the format makes optional take its defaults, and say so.
    with caplog.at_level("INFO"):
        source = _metadata_only_gguf(
            tmp_path / "defaults.gguf", {}, dropped=("llama.rope.freq_base", "llama.attention.head_count_kv")
        )
        config = load_model_config(source)
    assert (config.rope_theta, config.num_key_value_heads, config.vocab_size) == (10000.0, 4, 256)
    assert "no llama.rope.freq_base: using the format's default 10000.0" in caplog.text
    assert "no llama.attention.head_count_kv" in caplog.text


def test_an_unreadable_metadata_value_is_named(tmp_path):
    from pagellm.model.checkpoint.gguf_metadata import gguf_model_config

    source = _metadata_only_gguf(tmp_path / "ok.gguf", {})
    reader = open_gguf(source.path)

    class Unreadable:  # a field whose bytes the reader cannot decode
        data = [0]

        def contents(self):  # noqa: ANN202
            raise ValueError("bad bytes")

    reader.fields["llama.rope.freq_base"] = Unreadable()
    with pytest.raises(ModelLoadError, match="llama.rope.freq_base in .* cannot be read"):
        gguf_model_config(reader, source.path)
