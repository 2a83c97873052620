"""Model stage: every checkpoint's tensors in one layout, the one Llama checkpoints have:
separate q/k/v and gate/up projections, one tensor per expert, Llama's names.

- Fused projections (Phi-3's `qkv_proj` and `gate_up_proj`; llama.cpp's `attn_qkv`, and
  Phi-3's `ffn_up` holding gate and up) are cut into the separate projections.
- Qwen3-Next's Gated DeltaNet projections, fused per key head (`in_proj_qkvz`: each key
  head's q, k, then its value heads' v and z rows; `in_proj_ba`: its value heads' b, then
  a rows), are regathered into Qwen3.5's separate `in_proj_qkv` (all q, all k, all v),
  `in_proj_z`, `in_proj_b` and `in_proj_a`.
- Stacked experts (llama.cpp's `ffn_gate_exps` [experts, rows, cols], transformers 5's
  in-memory `experts.gate_up_proj`) are cut into one tensor per expert.
- Mixtral's names (`block_sparse_moe.experts.N.w1/w2/w3`) become `mlp.experts.N.gate_proj/
  down_proj/up_proj`, Qwen3-MoE's.
- A multimodal checkpoint's language model (Gemma 3's `language_model.model.*`, or
  `model.language_model.*` as transformers 5.x saves it) is read under a text model's
  names; its vision tower and projector are skipped.

So one path (the model's stacking, tensor-parallel sharding, quantized parts) serves all,
and it runs before sharding: a rank's share is cut from projections, never from a fused block.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import TypeVar

from pagellm.config.model import ModelConfig

Rows = TypeVar("Rows")  # a torch tensor or a numpy array, cut along its first axis


def fused_pieces(hf_name: str, config: ModelConfig) -> list[tuple[str, int, int]] | None:
    """(name, first row, end row) of each projection inside a fused tensor, or None when
    `hf_name` is not a fused one."""
    for fused, parts in (("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")), ("mlp.gate_up_proj", ("gate_proj", "up_proj"))):  # fmt: skip
        marker = f".{fused}."
        if marker not in hf_name:
            continue
        prefix, suffix = hf_name.split(marker)
        module = fused.split(".")[0]
        if parts[0] == "q_proj":
            q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
            sizes = (q, kv, kv)
        else:
            width = config.expert_intermediate_size if ".experts." in hf_name else config.intermediate_size
            if ".shared_expert." in hf_name:
                width = config.shared_expert_intermediate_size
            sizes = (width, width)
        pieces, start = [], 0
        for part, size in zip(parts, sizes, strict=True):
            pieces.append((f"{prefix}.{module}.{part}.{suffix}", start, start + size))
            start += size
        return pieces
    return None


_MIXTRAL_EXPERT = re.compile(r"\.block_sparse_moe\.(gate|experts\.\d+\.(w[123]))\.")
_MIXTRAL_PROJECTION = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
# Experts stacked in one tensor: [experts, rows, cols] (transformers' names end without .weight).
# gpt-oss's files stack the experts' biases too ([experts, rows]).
_STACKED_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|gate_proj|up_proj|down_proj)(\.weight|\.bias)?$")


_LANGUAGE_MODEL_PREFIXES = (
    ("language_model.model.", "model."),  # checkpoints saved by transformers 4.x
    ("model.language_model.", "model."),  # ... by transformers 5.x
    ("language_model.lm_head.", "lm_head."),
)
# The vision tower (Gemma 3's; Qwen3.5's `visual`) and Qwen3.5's multi-token-prediction
# head (`mtp.`, for speculative decoding by the model itself): not loaded.
_VISION_PREFIXES = (
    "vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.",
    "model.visual.", "visual.", "mtp.", "model.mtp.",
    # Gemma 4's audio tower and its vision and audio embedders.
    "model.audio_tower.", "model.embed_vision.", "model.embed_audio.",
)  # fmt: skip


def language_model_name(hf_name: str) -> str | None:
    """A tensor's name in a text-only model: a multimodal checkpoint's language model
    renamed, its vision parts None (not loaded); every other name as it is."""
    if hf_name.startswith(_VISION_PREFIXES):
        return None
    for prefix, text_prefix in _LANGUAGE_MODEL_PREFIXES:
        if hf_name.startswith(prefix):
            return text_prefix + hf_name[len(prefix) :]
    return hf_name


def renamed(hf_name: str) -> str:
    """Mixtral's expert and router names as Qwen3-MoE's (`mlp.experts.N.gate_proj`, `mlp.gate`)."""
    match = _MIXTRAL_EXPERT.search(hf_name)
    if match is None:
        return hf_name
    inner = match.group(1)
    if match.group(2) is not None:
        inner = inner[: -len(match.group(2))] + _MIXTRAL_PROJECTION[match.group(2)]
    return hf_name[: match.start()] + f".mlp.{inner}." + hf_name[match.end() :]


_PER_KEY_HEAD = re.compile(r"\.linear_attn\.in_proj_(qkvz|ba)\.weight$")


def _per_key_head_pieces(name: str, config: ModelConfig) -> list[tuple[str, list[int]]] | None:
    """(name, rows) of each projection gathered from a Qwen3-Next tensor fused per key head."""
    match = _PER_KEY_HEAD.search(name)
    spec = config.linear_attention
    if match is None or spec is None:
        return None
    prefix = name[: match.start()] + ".linear_attn.in_proj_"
    per_key = spec.num_value_heads // spec.num_key_heads
    if match.group(1) == "ba":
        sizes = {"b": per_key, "a": per_key}
    else:
        values = per_key * spec.value_head_dim
        sizes = {"q": spec.key_head_dim, "k": spec.key_head_dim, "v": values, "z": values}
    group = sum(sizes.values())
    rows: dict[str, list[int]] = {kind: [] for kind in sizes}
    for head in range(spec.num_key_heads):
        start = head * group
        for kind, size in sizes.items():
            rows[kind] += range(start, start + size)
            start += size
    if "q" in rows:
        return [(prefix + "qkv.weight", rows["q"] + rows["k"] + rows["v"]), (prefix + "z.weight", rows["z"])]
    return [(prefix + "b.weight", rows["b"]), (prefix + "a.weight", rows["a"])]


# gpt-oss's experts as transformers stores them unquantized: stacked, each matrix transposed
# ([experts, in, out]), gate and up interleaved column by column; its router is `mlp.router`.
_GPT_OSS_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$")
_GPT_OSS_ROUTER = re.compile(r"\.mlp\.router\.(weight|bias)$")


def _gpt_oss_pieces(name: str, rows: Rows) -> Iterator[tuple[str, Rows]] | None:
    """Llama's per-expert projections of a gpt-oss expert tensor (None: not one)."""
    match = _GPT_OSS_EXPERTS.search(name)
    if match is None:
        return None
    prefix, projection, suffix = name[: match.start()], match.group(1), "bias" if match.group(2) else "weight"

    def pieces() -> Iterator[tuple[str, Rows]]:
        for expert in range(rows.shape[0]):  # type: ignore[attr-defined]
            # A weight's [in, out] transposed to Llama's [out, in]; a bias is [out] already.
            one = rows[expert] if suffix == "bias" else rows[expert].T  # type: ignore[index,union-attr]
            base = f"{prefix}.mlp.experts.{expert}"
            if projection == "down_proj":
                yield f"{base}.down_proj.{suffix}", one
            else:  # columns 0, 2, 4, ... are the gate's, 1, 3, 5, ... the up projection's
                yield f"{base}.gate_proj.{suffix}", one[0::2]
                yield f"{base}.up_proj.{suffix}", one[1::2]

    return pieces()


# Gemma 4's experts beside the MLP: stacked [experts, rows, cols] under the layer itself,
# gate_up_proj holding the gate's rows, then the up projection's.
_GEMMA4_EXPERTS = re.compile(r"\.layers\.(\d+)\.experts\.(gate_up_proj|down_proj)(\.weight)?$")  # .weight: a GGUF's


def _gemma4_pieces(name: str, rows: Rows, config: ModelConfig) -> Iterator[tuple[str, Rows]] | None:
    """Llama's per-expert projections (under the layer's `moe` block) of a Gemma 4 expert tensor (None: not one)."""
    match = _GEMMA4_EXPERTS.search(name)
    if match is None or not config.experts_beside_mlp:
        return None
    prefix, projection, width = name[: match.start()], match.group(2), config.expert_intermediate_size

    def pieces() -> Iterator[tuple[str, Rows]]:
        for expert in range(rows.shape[0]):  # type: ignore[attr-defined]
            base = f"{prefix}.layers.{match.group(1)}.moe.experts.{expert}"
            one = rows[expert]  # type: ignore[index]
            if projection == "down_proj":
                yield f"{base}.down_proj.weight", one
            else:
                yield f"{base}.gate_proj.weight", one[:width]
                yield f"{base}.up_proj.weight", one[width:]

    return pieces()


def split_fused(name: str, rows: Rows, config: ModelConfig) -> Iterator[tuple[str, Rows]]:
    """The tensor (renamed), or its projections when it is a fused or stacked one. A fused
    tensor whose rows do not add up to the config's sizes is left whole (the model names it)."""
    name = renamed(name)
    gemma4 = _gemma4_pieces(name, rows, config)
    if gemma4 is not None:
        yield from gemma4
        return
    if config.expert_bias:  # gpt-oss
        name = _GPT_OSS_ROUTER.sub(r".mlp.gate.\1", name)
        gpt_oss = _gpt_oss_pieces(name, rows)
        if gpt_oss is not None:
            yield from gpt_oss
            return
    gathered = _per_key_head_pieces(name, config)
    if gathered is not None and sum(len(r) for _, r in gathered) == rows.shape[0]:  # type: ignore[attr-defined]
        for piece, indices in gathered:
            yield piece, rows[indices]  # type: ignore[index]
        return
    stacked = _STACKED_EXPERTS.search(name)
    is_bias = stacked is not None and stacked.group(2) == ".bias"
    if stacked is not None and rows.ndim == (2 if is_bias else 3):  # type: ignore[attr-defined]
        prefix, suffix = name[: stacked.start()], "bias" if is_bias else "weight"
        for expert in range(rows.shape[0]):  # type: ignore[attr-defined]
            yield from split_fused(f"{prefix}.mlp.experts.{expert}.{stacked.group(1)}.{suffix}", rows[expert], config)  # type: ignore[index]
        return
    pieces = fused_pieces(name, config)
    if pieces is None or pieces[-1][2] != rows.shape[0]:  # type: ignore[attr-defined]
        yield name, rows
        return
    for piece, start, end in pieces:
        yield piece, rows[start:end]  # type: ignore[index]
