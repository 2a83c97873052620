"""Model stage: the building blocks of a Llama-family layer (norm, rotary embedding)."""

from __future__ import annotations

import math

import torch
from torch import nn

from pagellm.config.model import ModelConfig, RopeScaling


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in float32 whatever the model dtype, as the reference does.
        dtype = x.dtype
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(-1, keepdim=True)
        x32 = x32 * torch.rsqrt(variance + self.eps)
        return self.weight * x32.to(dtype)


class OffsetRMSNorm(RMSNorm):
    """x / rms(x) * (1 + w), all in float32, rounded once at the end (Gemma, Qwen3.5: the
    stored weight is the offset from 1; llama.cpp's files store 1 + w, the GGUF loader
    takes 1 off)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__(hidden_size, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


def rope_inv_freq(
    head_dim: int, theta: float, scaling: RopeScaling | None
) -> torch.Tensor:  # [head_dim // 2] float32
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim)
    )
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    if scaling.rope_type == "longrope":  # the short factors; RotaryEmbedding adds the long ones
        return longrope_inv_freq(scaling.short_factor, head_dim, theta)
    # llama3: long wavelengths are slowed by `factor`, short ones kept, and the band in
    # between interpolated smoothly.
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def longrope_inv_freq(factors: tuple[float, ...] | None, head_dim: int, theta: float) -> torch.Tensor:
    """LongRoPE's frequencies: each one divided by its own factor, as transformers computes them."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**exponents)


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): dimensions that turn fewer than `beta_slow` times over the
    original context are interpolated (divided by `factor`), those turning more than
    `beta_fast` times kept, with a linear ramp between."""

    def dimension_of(rotations: float) -> float:  # the dimension that turns `rotations` times
        return head_dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension_of(scaling.beta_fast), dimension_of(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of no width
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (the original frequency), 0: interpolate
    return inv_freq / scaling.factor * (1 - keep) + inv_freq * keep


def rope_attention_factor(scaling: RopeScaling | None) -> float:
    """What cos and sin are multiplied by: YaRN's and LongRoPE's attention temperature, else 1."""
    if scaling is None or scaling.rope_type not in ("yarn", "longrope"):
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.rope_type == "longrope":
        if scaling.factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(scaling.factor) / math.log(scaling.original_max_position_embeddings))

    def mscale(factor: float, scale: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return mscale(scaling.factor, scaling.mscale) / mscale(scaling.factor, scaling.mscale_all_dim)
    return mscale(scaling.factor)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the "rotate half" layout of HF checkpoints.

    cos/sin are precomputed in float32 for every position up to max_positions and
    looked up per token, so a flattened batch with arbitrary positions costs one gather.
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: RopeScaling | None = None,
        freq_divisors: torch.Tensor | None = None,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        # Partial rotary (Phi-4-mini): only the first rotary_dim dimensions of a head turn.
        self.rotary_dim = rotary_dim or head_dim
        inv_freq = rope_inv_freq(self.rotary_dim, theta, scaling)
        if freq_divisors is not None:
            # GGUF files of Llama 3 models store the scaling as per-frequency divisors.
            inv_freq = inv_freq / freq_divisors.to(torch.float32)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_positions, rotary_dim // 2]
        if scaling is not None and scaling.rope_type == "longrope":
            # Positions from the original context on turn by the long factors. transformers
            # picks one set per forward by the longest position in it, which for a decode
            # step is this same rule; a prompt longer than the original context is the one
            # difference (there it rotates every prompt position by the long set).
            original = min(scaling.original_max_position_embeddings, max_positions)
            long_inv_freq = longrope_inv_freq(scaling.long_factor, self.rotary_dim, theta)
            freqs[original:] = torch.outer(positions[original:], long_inv_freq)
        attention_factor = rope_attention_factor(scaling)
        self.register_buffer("cos_cache", freqs.cos() * attention_factor, persistent=False)
        self.register_buffer("sin_cache", freqs.sin() * attention_factor, persistent=False)

    @classmethod
    def for_model(cls, config: ModelConfig, freq_divisors: torch.Tensor | None = None) -> RotaryEmbedding:
        return cls(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling, freq_divisors,
            config.rotary_dim,
        )  # fmt: skip

    def lookup(
        self, positions: torch.Tensor, dtype: torch.dtype  # positions: [num_tokens]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin: [num_tokens, 1, head_dim // 2]
        """cos/sin of each token's position, once per forward for all layers."""
        cos = self.cos_cache[positions].unsqueeze(1).to(dtype)
        sin = self.sin_cache[positions].unsqueeze(1).to(dtype)
        return cos, sin


def apply_rotary(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k turned by their positions' angles (`cos_sin` None: a layer without rotary, unchanged)."""
    if cos_sin is None:
        return query, key
    cos, sin = cos_sin
    return _rotate(query, cos, sin), _rotate(key, cos, sin)


def apply_rotary_one(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """One of q or k turned by its positions' angles (a layer that reads another's keys turns only q)."""
    return x if cos_sin is None else _rotate(x, *cos_sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = cos.shape[-1]  # rotary_dim // 2: the dimensions past rotary_dim pass unchanged
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    rotated = (x1 * cos - x2 * sin, x2 * cos + x1 * sin)
    if 2 * half == x.shape[-1]:
        return torch.cat(rotated, dim=-1)
    return torch.cat((*rotated, x[..., 2 * half :]), dim=-1)
