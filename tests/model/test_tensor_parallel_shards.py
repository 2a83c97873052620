"""One rank's share of each tensor (pagellm/model/tensor_parallel.py), checked exactly:
quantized blocks split as stored dequantize to the same values as the float tensor split,
the layout's head/KV/vocabulary ranges, and the refusal of degrees that do not split."""

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from pagellm.errors import ConfigError
from pagellm.kernels.weights import WeightType, block_bytes
from pagellm.config.model import ModelConfig
from pagellm.config.parallel import check_tp_size, valid_tp_sizes
from pagellm.model.tensor_parallel import TPLayout, shard_blocks, shard_float

T = gguf.GGMLQuantizationType


def config(**overrides):
    shape = dict(
        architecture="llama", vocab_size=250, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
        num_attention_heads=8, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
    )  # fmt: skip
    shape.update(overrides)
    return ModelConfig(**shape)


def test_layout_splits_heads_and_replicates_kv_heads_below_the_degree():
    cfg = config()
    two = [TPLayout.of(cfg, rank, 2) for rank in range(2)]
    assert [(t.num_heads, t.num_kv_heads, t.first_kv_head) for t in two] == [(4, 1, 0), (4, 1, 1)]
    four = [TPLayout.of(cfg, rank, 4) for rank in range(4)]
    # 2 KV heads over 4 ranks: ranks 0-1 hold head 0, ranks 2-3 head 1.
    assert [t.first_kv_head for t in four] == [0, 0, 1, 1] and all(t.num_kv_heads == 1 for t in four)
    assert four[3].out_rows("model.layers.0.self_attn.k_proj.weight") == range(32, 64)
    assert four[3].out_rows("model.layers.0.self_attn.q_proj.weight") == range(6 * 32, 8 * 32)
    # 250 tokens over 4 ranks: 63 rows each, the last rank's final 2 rows padding.
    assert four[3].vocab_per_rank == 63 and four[3].out_rows("lm_head.weight") == range(189, 252)
    local = four[1].local_config(cfg)
    assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size) == (2, 1, 128)


@pytest.mark.parametrize("tiled", [False, True], ids=["grouped", "tiled"])
def test_a_hybrids_linear_heads_split_with_their_value_heads(tiled):
    """2 key heads of 4 dims, 4 value heads of 3 dims, over 2 ranks: rank 1 keeps key head 1
    and the value heads that read it (2 and 3 grouped; 1 and 3 tiled), in each part of the
    fused q/k/v rows and the conv, z, b, a, A_log, dt_bias, and out_proj's columns; the
    gated q_proj's rows are two head_dims a head."""
    from pagellm.config.model import LinearAttentionSpec

    spec = LinearAttentionSpec((0,), num_key_heads=2, num_value_heads=4, key_head_dim=4, value_head_dim=3, value_heads_tiled=tiled)
    rank1 = TPLayout.of(config(linear_attention=spec, attention_output_gate=True), 1, 2)
    heads = [(6, 12)] if not tiled else [(3, 6), (9, 12)]  # value-head rows of width 3
    layer = "model.layers.0.linear_attn."
    assert rank1.out_pieces(layer + "in_proj_qkv.weight") == [range(4, 8), range(12, 16)] + [range(16 + a, 16 + b) for a, b in heads]
    assert rank1.out_pieces(layer + "conv1d.weight") == rank1.out_pieces(layer + "in_proj_qkv.weight")
    assert rank1.out_pieces(layer + "in_proj_z.weight") == [range(a, b) for a, b in heads]
    single = [range(2, 4)] if not tiled else [range(1, 2), range(3, 4)]
    for name in ("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias"):
        assert rank1.out_pieces(layer + name) == single, name
    assert rank1.in_pieces(layer + "out_proj.weight") == [range(a, b) for a, b in heads]
    assert rank1.out_pieces(layer + "norm.weight") is None and rank1.in_pieces(layer + "norm.weight") is None
    weight = torch.arange(12 * 5.0).reshape(12, 5)  # out_proj: [hidden, value heads x dim], transposed here
    assert torch.equal(shard_float(rank1, layer + "out_proj.weight", weight.t()), torch.cat([weight[a:b] for a, b in heads]).t())
    assert rank1.out_rows("model.layers.1.self_attn.q_proj.weight") == range(4 * 64, 8 * 64)


def test_a_degree_that_does_not_split_names_the_ones_that_do():
    cfg = config(num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536, hidden_size=576, head_dim=64)
    assert valid_tp_sizes(cfg) == [1, 3]  # 9 splits the heads but not the 1536-wide MLP
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2 does not split this model: 9 attention heads, "
                       r"3 KV heads.*sizes that work: \[1, 3\]"):  # fmt: skip
        check_tp_size(cfg, 2)
    with pytest.raises(ConfigError, match=">= 1"):
        check_tp_size(cfg, 0)


def test_float_shards_reassemble_the_tensor():
    cfg = config()
    weight = torch.randn(256, 512)  # down_proj: [hidden, intermediate]
    parts = [shard_float(TPLayout.of(cfg, r, 2), "model.layers.0.mlp.down_proj.weight", weight) for r in range(2)]
    assert torch.equal(torch.cat(parts, dim=1), weight)
    bias = torch.randn(256)
    biases = [shard_float(TPLayout.of(cfg, r, 2), "model.layers.0.self_attn.o_proj.bias", bias) for r in range(2)]
    assert torch.equal(biases[0], bias) and not biases[1].any()  # added once, after the sum
    embed = torch.randn(250, 256)
    rows = [shard_float(TPLayout.of(cfg, r, 4), "model.embed_tokens.weight", embed) for r in range(4)]
    assert torch.equal(torch.cat(rows)[:250], embed) and not torch.cat(rows)[250:].any()


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1])
@pytest.mark.parametrize("name", ["model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.gate_proj.weight",
                                  "model.layers.0.self_attn.o_proj.weight"])  # fmt: skip
def test_quantized_shards_dequantize_to_the_float_shards(qtype, name):
    cfg = config()
    shape = {"down_proj": (256, 512), "gate_proj": (512, 256), "o_proj": (256, 256)}[name.split(".")[-2]]
    values = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    blocks = quantize(values, qtype)  # uint8 [rows, bytes of blocks]
    full = torch.from_numpy(dequantize(blocks, qtype).reshape(shape))
    weight_type = WeightType(int(qtype))
    for rank in range(2):
        layout = TPLayout.of(cfg, rank, 2)
        part = shard_blocks(layout, name, blocks, weight_type.block_elements, block_bytes(weight_type))
        assert part is not None
        expected = shard_float(layout, name, full)
        got = torch.from_numpy(dequantize(part, qtype).reshape(expected.shape))
        assert torch.equal(got, expected)


def test_a_column_split_that_cuts_a_block_is_declined():
    cfg = config(hidden_size=256, num_attention_heads=8)  # o_proj: 256 columns, 128 per rank
    blocks = np.zeros((256, 256 // 256 * 144), np.uint8)  # Q4_K: one 256-value block per row
    layout = TPLayout.of(cfg, 0, 2)
    assert shard_blocks(layout, "model.layers.0.self_attn.o_proj.weight", blocks, 256, 144) is None
    # Rows split fine whatever the block size.
    assert shard_blocks(layout, "model.layers.0.self_attn.q_proj.weight", blocks, 256, 144).shape == (128, 144)
