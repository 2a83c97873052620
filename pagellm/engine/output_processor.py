"""Engine stage: turn the scheduler's per-step progress into RequestOutputs with text."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagellm.core.scheduler_output import RequestProgress
from pagellm.outputs import CompletionOutput, RequestOutput
from pagellm.sampling_params import SamplingParams
from pagellm.tokenizer import Tokenizer


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    text: str = ""


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(self, state: RequestState) -> None:
        self.states[state.request_id] = state

    def has_request(self, request_id: str) -> bool:
        return request_id in self.states

    def process(
        self, progress: list[RequestProgress], num_cached_tokens: dict[str, int]
    ) -> list[RequestOutput]:
        outputs = []
        for item in progress:
            state = self.states.get(item.req_id)
            if state is None:
                continue
            state.output_token_ids.extend(item.new_token_ids)
            if item.new_token_ids or item.finished:
                state.text = self.tokenizer.decode(
                    state.output_token_ids, skip_special_tokens=state.params.skip_special_tokens
                )
            if item.finished:
                del self.states[item.req_id]
            outputs.append(
                RequestOutput(
                    request_id=state.request_id,
                    prompt=state.prompt,
                    prompt_token_ids=state.prompt_token_ids,
                    outputs=[
                        CompletionOutput(
                            index=0,
                            text=state.text,
                            token_ids=list(state.output_token_ids),
                            finish_reason=str(item.finish_reason) if item.finished else None,
                            stop_reason=item.stop_reason,
                        )
                    ],
                    finished=item.finished,
                    num_cached_tokens=num_cached_tokens.get(item.req_id, 0),
                )
            )
        return outputs

    def abort(self, request_id: str) -> RequestOutput | None:
        state = self.states.pop(request_id, None)
        if state is None:
            return None
        return RequestOutput(
            request_id=request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[
                CompletionOutput(0, state.text, list(state.output_token_ids), finish_reason="abort")
            ],
            finished=True,
        )
