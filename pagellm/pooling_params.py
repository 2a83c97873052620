"""Request-level pooling parameters (input stage): how a prompt becomes one embedding.

An embedding request is a prompt-only request: the scheduler runs its prefill like any
other (batched with generation, chunked, prefix-cached where the pooling allows), and when
its last prompt token is computed the runner pools the final hidden states of its
positions instead of sampling. Pure Python (no torch), so the scheduler can read them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from pagellm.errors import InvalidRequestError

# "last": the last token's hidden state (decoder embedding models: Qwen3-Embedding,
# e5-mistral, and any causal model); "mean": the average over the prompt's positions;
# "cls": the first position's.
POOLING_TYPES = ("last", "mean", "cls")
# "embed": the pooled vector; "classify": a sequence classifier's head applied to the last
# token's pooled hidden state (its raw logits, one per label), as HF's *ForSequenceClassification.
POOLING_TASKS = ("embed", "classify")


@dataclass(frozen=True)
class PoolingParams:
    """How to pool one request's hidden states, with vLLM's meaning.

    `pooling_type` and `normalize` left None take the model's own (ModelConfig:
    `pooling_type`, L2 normalisation on by default, as vLLM does). `dimensions` keeps the
    first values of the embedding (Matryoshka truncation, before normalising), only for
    models trained for it. `task` "classify" asks a sequence classifier for its logits.
    """

    pooling_type: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None
    task: str = "embed"
    # What SamplingParams says of a request that code handling either kind reads: one
    # sequence, no output constraint.
    n: ClassVar[int] = 1
    structured_outputs: ClassVar[None] = None

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise InvalidRequestError(f"task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}.", "task")
        if self.task == "classify" and (self.pooling_type not in (None, "last") or self.normalize or self.dimensions):
            raise InvalidRequestError(
                "a classification pools the last token and returns the head's raw logits: pooling_type, "
                "normalize and dimensions do not apply.",
                "task",
            )
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise InvalidRequestError(
                f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}.", "pooling_type"
            )
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise InvalidRequestError(f"normalize must be a boolean, got {self.normalize!r}.", "normalize")
        if self.dimensions is not None:
            if isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int):
                raise InvalidRequestError(f"dimensions must be an integer, got {self.dimensions!r}.", "dimensions")
            if self.dimensions < 1:
                raise InvalidRequestError(f"dimensions must be at least 1, got {self.dimensions}.", "dimensions")

    @property
    def needs_every_position(self) -> bool:
        """Whether pooling reads positions before the last one: then the whole prompt is
        computed (no prefix-cache hit, whose positions would never reach the runner)."""
        return self.pooling_type in ("mean", "cls")

    def resolved(
        self,
        model_pooling_type: str,
        hidden_size: int,
        matryoshka: bool,
        matryoshka_dimensions: tuple[int, ...] | None,
    ) -> PoolingParams:
        """The parameters with the model's defaults filled in and `dimensions` checked
        against what the model allows."""
        if self.task == "classify":
            return replace(self, pooling_type="last", normalize=False)
        if self.dimensions is not None and self.dimensions != hidden_size:  # its own size shortens nothing
            if not matryoshka:
                raise InvalidRequestError(
                    "dimensions: this model does not support Matryoshka embeddings (its config declares neither "
                    "is_matryoshka nor matryoshka_dimensions), so its embeddings cannot be shortened.",
                    "dimensions",
                )
            if matryoshka_dimensions and self.dimensions not in matryoshka_dimensions:
                allowed = ", ".join(str(d) for d in matryoshka_dimensions)
                raise InvalidRequestError(
                    f"dimensions must be one of the model's Matryoshka sizes ({allowed}), got {self.dimensions}.",
                    "dimensions",
                )
            if self.dimensions > hidden_size:
                raise InvalidRequestError(
                    f"dimensions must be at most the model's embedding size {hidden_size}, got {self.dimensions}.",
                    "dimensions",
                )
        return replace(
            self,
            pooling_type=self.pooling_type or model_pooling_type,
            normalize=True if self.normalize is None else self.normalize,
        )
