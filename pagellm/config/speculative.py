"""Config stage: speculative decoding's settings (vLLM's speculative_config)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from pagellm.config.validation import check_int
from pagellm.errors import ConfigError

SPECULATIVE_METHODS: tuple[str, ...] = ("ngram", "draft_model")


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's speculative_config): `ngram` proposes, for each
    decode, up to num_speculative_tokens that followed the latest earlier occurrence of
    its last n tokens (n from prompt_lookup_max down to prompt_lookup_min); `draft_model`
    (given as {"model": PATH, ...}) runs a smaller model with the same vocabulary to
    propose them. The target model verifies them in the same step. No step speculates
    with more running requests than disable_by_batch_size (there decoding is
    compute-bound and verification costs more than it saves)."""

    method: str = "ngram"
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    disable_by_batch_size: int | None = 8
    model: str | None = None  # the draft model (GGUF file or HF folder)

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(f"speculative_config.method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ConfigError(
                "speculative_config: a draft model needs method 'draft_model' and a model path"
                if self.method == "draft_model"
                else f"speculative_config: method {self.method!r} takes no model (a draft model is method 'draft_model')"
            )
        check_int("speculative_config", "num_speculative_tokens", self.num_speculative_tokens, 1)
        check_int("speculative_config", "prompt_lookup_min", self.prompt_lookup_min, 1)
        check_int("speculative_config", "prompt_lookup_max", self.prompt_lookup_max, self.prompt_lookup_min)
        if self.disable_by_batch_size is not None:
            check_int("speculative_config", "disable_by_batch_size", self.disable_by_batch_size, 1)

    @classmethod
    def from_dict(cls, values: dict[str, object]) -> SpeculativeConfig:
        """From the user's dict (or JSON object); {"model": ...} alone means method 'draft_model'."""
        values = dict(values)
        if values.get("model") is not None:
            values.setdefault("method", "draft_model")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"speculative_config: unknown key(s) {unknown} (known: {sorted(known)})")
        if "num_speculative_tokens" not in values:
            raise ConfigError("speculative_config needs num_speculative_tokens")
        return cls(**values)  # type: ignore[arg-type]


def resolve_speculative_config(value: object) -> SpeculativeConfig | None:
    """--speculative-config: None, a dict, or its JSON text."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ConfigError(f"speculative_config is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"speculative_config must be a JSON object, got {value!r}")
    return SpeculativeConfig.from_dict(value)
