"""Entrypoints stage: the offline API, `LLM(model=...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Any

from pagellm.config.engine_args import EngineArgs
from pagellm.engine.llm_engine import LLMEngine
from pagellm.errors import InvalidRequestError
from pagellm.lora.request import LoRARequest
from pagellm.entrypoints.scoring import plan_scoring
from pagellm.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput, ScoringOutput, ScoringRequestOutput
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int] | dict[str, Any]


class LLM:
    """An engine for offline batch generation.

    `LLM(model="path/to/model.gguf", max_num_seqs=64, ...)` takes every EngineArgs field
    as a keyword; with no model it loads the embedded SmolLM2-135M-Instruct.
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        args = EngineArgs.from_kwargs(model=model, **engine_args)
        self.engine = LLMEngine.from_engine_args(args)
        self._counter = 0

    def shutdown(self) -> None:
        """Stop the engine's worker processes (tensor parallelism) and close its files.
        Also done at interpreter exit; the LLM cannot generate afterwards."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1) and the weights too (level 2) until wake_up or the
        next request (as vLLM's LLM.sleep)."""
        self.engine.sleep(level)

    def wake_up(self) -> None:
        self.engine.wake_up()

    def get_metrics(self):  # noqa: ANN201 - pagellm.metrics.engine_metrics.MetricsSnapshot
        """The engine's counters, gauges and latency summaries (see README: Metrics)."""
        return self.engine.get_metrics()

    def get_tokenizer(self):  # noqa: ANN201 - pagellm.tokenizer.Tokenizer
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of the prompts.

        A prompt is a string, a list of token ids, or {"prompt": str} /
        {"prompt_token_ids": [...]}. A single prompt may be passed without a list.
        lora_request: the adapter every prompt runs under, or one per prompt (None: the
        base model); needs LLM(enable_lora=True).
        """
        prompt_list = _as_prompt_list(prompts)
        if isinstance(sampling_params, SamplingParams) or sampling_params is None:
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise InvalidRequestError(
                    f"got {len(params_list)} sampling params for {len(prompt_list)} prompts",
                    "sampling_params",
                )
        if priority is not None and len(priority) != len(prompt_list):
            raise InvalidRequestError(
                f"got {len(priority)} priorities for {len(prompt_list)} prompts", "priority"
            )
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompt_list)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompt_list):
                raise InvalidRequestError(f"got {len(loras)} LoRA requests for {len(prompt_list)} prompts", "lora_request")
        request_ids: list[str] = []
        try:
            for i, (prompt, params) in enumerate(zip(prompt_list, params_list)):
                request_id = f"offline-{self._counter}"
                self._counter += 1
                self.engine.add_request(
                    request_id,
                    _prompt_value(prompt),
                    params,
                    priority=priority[i] if priority is not None else 0,
                    lora_request=loras[i],
                )
                request_ids.append(request_id)
            return self._run(request_ids, use_tqdm)
        except BaseException:
            # A bad prompt (or Ctrl-C) must not leave earlier ones queued in the engine.
            self.engine.abort_request(request_ids)
            raise

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in the order of the prompts: the model's final hidden
        states pooled (its own pooling: last token unless the checkpoint says mean or CLS)
        and L2-normalised, unless `pooling_params` says otherwise. The prompts run through
        the same scheduler as generation (batched, chunked, prefix-cached)."""
        prompt_list = [_prompt_value(prompt) for prompt in _as_prompt_list(prompts)]
        outputs = self._run_pooled(prompt_list, pooling_params or PoolingParams(), use_tqdm)
        return [
            EmbeddingRequestOutput(
                output.request_id, output.prompt_token_ids, EmbeddingOutput(output.embedding or []),
                num_cached_tokens=output.num_cached_tokens,
            )  # fmt: skip
            for output in outputs
        ]

    def score(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        use_tqdm: bool = True,
    ) -> list[ScoringRequestOutput]:
        """Score text pairs, as vLLM's LLM.score: one text against each of a list (1:N, or
        N:1), or two lists of the same length pairwise. A cross-encoder (a sequence classifier with
        one label) scores each pair as one prompt (sigmoid of its logit); any other model
        by the cosine similarity of the two texts' embeddings. One output per pair, in order."""
        plan = plan_scoring(self.engine.model_config, self.engine.tokenizer, text_1, text_2)
        outputs = self._run_pooled(plan.prompts, plan.params, use_tqdm)
        scores = plan.scores([output.embedding or [] for output in outputs])
        results = []
        for (a, b), score in zip(plan.pairs, scores, strict=True):
            tokens = list(outputs[a].prompt_token_ids) + ([] if a == b else list(outputs[b].prompt_token_ids))
            results.append(ScoringRequestOutput(outputs[a].request_id, tokens, ScoringOutput(score)))
        return results

    def _run_pooled(
        self, prompts: Sequence[str | Sequence[int]], params: PoolingParams, use_tqdm: bool
    ) -> list[RequestOutput]:
        """Prompt-only requests (embeddings, scores) run to their pooled outputs, in order;
        none is left queued if one is refused (or on Ctrl-C)."""
        request_ids: list[str] = []
        try:
            for prompt in prompts:
                request_id = f"offline-{self._counter}"
                self._counter += 1
                self.engine.add_request(request_id, prompt, params)
                request_ids.append(request_id)
            return self._run(request_ids, use_tqdm)
        except BaseException:
            self.engine.abort_request(request_ids)
            raise

    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of conversations.

        Each conversation is a list of {"role": ..., "content": ...} messages, rendered
        with the model's chat template (or `chat_template`).
        """
        if not isinstance(messages, Sequence) or isinstance(messages, (str, dict)) or not messages:
            raise InvalidRequestError(
                "messages must be a conversation (list of messages) or a list of them",
                "messages",
            )
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        tokenizer = self.engine.tokenizer
        prompts: list[Prompt] = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(
                list(conversation),
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
            )
            # The template writes special tokens (BOS etc.) itself.
            prompts.append(tokenizer.encode(text, add_special_tokens=False))
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        progress = None
        if use_tqdm and sys.stderr.isatty():
            from tqdm import tqdm

            progress = tqdm(total=len(request_ids), desc="generating", unit="req")
        try:
            while len(finished) < len(request_ids):
                for output in self.engine.step():
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
                        if progress is not None:
                            progress.update(1)
        finally:
            if progress is not None:
                progress.close()
        return [finished[rid] for rid in request_ids]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    if isinstance(prompts, Sequence):
        return list(prompts)
    raise InvalidRequestError(
        f"prompts must be a string, token ids, or a list of them; got {type(prompts).__name__}",
        "prompts",
    )


def _prompt_value(prompt: Prompt) -> str | Sequence[int]:
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt["prompt_token_ids"]
        if "prompt" in prompt:
            return prompt["prompt"]
        raise InvalidRequestError(
            "a prompt dict needs 'prompt' or 'prompt_token_ids'", "prompts"
        )
    return prompt
