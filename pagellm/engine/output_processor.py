"""Engine stage: turn each step's progress into RequestOutputs with text and deltas.

A request with n completions is tracked here as one RequestState with n
CompletionStates; the scheduler sees n requests (the request's own id for completion 0,
`child_request_id(id, i)` for the others).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagellm.core.scheduler_output import RequestProgress, TokenLogprobs
from pagellm.engine.detokenizer import IncrementalDetokenizer
from pagellm.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from pagellm.request import child_request_id
from pagellm.sampling_params import SamplingParams
from pagellm.tokenizer import Tokenizer


@dataclass
class CompletionState:
    index: int
    detokenizer: IncrementalDetokenizer
    logprobs: list[PositionLogprobs] | None
    cumulative_logprob: float | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[PositionLogprobs] = field(default_factory=list)


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    completions: list[CompletionState]
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    embedding: list[float] | None = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)


@dataclass
class StepResult:
    outputs: list[RequestOutput]
    # Scheduler request ids that a stop string ended: the engine finishes them.
    stopped_req_ids: list[str]


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}
        # scheduler request id -> (state, completion index)
        self._completions: dict[str, tuple[RequestState, int]] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> None:
        completions = [
            CompletionState(
                index=i,
                detokenizer=IncrementalDetokenizer(
                    self.tokenizer,
                    params.skip_special_tokens,
                    params.stop,
                    params.include_stop_str_in_output,
                ),
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
            )
            for i in range(params.n)
        ]
        state = RequestState(request_id, prompt, prompt_token_ids, params, completions)
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
        self.states[request_id] = state
        for i in range(params.n):
            scheduler_id = request_id if i == 0 else child_request_id(request_id, i)
            self._completions[scheduler_id] = (state, i)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.states

    def scheduler_ids(self, request_id: str) -> list[str]:
        """Scheduler ids of every completion of a request."""
        state = self.states.get(request_id)
        if state is None:
            return []
        return [request_id] + [child_request_id(request_id, i) for i in range(1, len(state.completions))]

    def process(
        self,
        progress: list[RequestProgress],
        logprobs: dict[str, list[TokenLogprobs]] | None,
        prompt_logprobs: dict[str, list[TokenLogprobs]] | None,
        num_cached_tokens: dict[str, int],
        pooled: dict[str, list[float]] | None = None,
    ) -> StepResult:
        touched: dict[str, RequestState] = {}
        stopped: list[str] = []
        for req_id, entries in (prompt_logprobs or {}).items():
            found = self._completions.get(req_id)
            if found is None:
                continue
            state = found[0]
            # A recomputed prompt (after preemption) reports its positions again.
            if state.prompt_logprobs is not None and len(state.prompt_logprobs) < len(state.prompt_token_ids):
                state.prompt_logprobs.extend(self._position_logprobs(e) for e in entries)
        for req_id, num_cached in num_cached_tokens.items():
            found = self._completions.get(req_id)
            if found is not None and found[1] == 0:
                state = found[0]
                state.num_cached_tokens = max(state.num_cached_tokens, num_cached)
        for req_id, embedding in (pooled or {}).items():
            found = self._completions.get(req_id)
            if found is not None:
                found[0].embedding = embedding
        for item in progress:
            found = self._completions.get(item.req_id)
            if found is None:
                continue
            state, index = found
            completion = state.completions[index]
            if completion.finish_reason is not None:
                continue
            touched[state.request_id] = state
            self._add_tokens(completion, item.new_token_ids, (logprobs or {}).get(item.req_id))
            stop = completion.detokenizer.add_tokens(item.new_token_ids)
            if stop is not None:
                completion.finish_reason, completion.stop_reason = "stop", stop
                if not item.finished:
                    stopped.append(item.req_id)
            elif item.finished:
                stop = completion.detokenizer.finish()
                if stop is not None:
                    completion.finish_reason, completion.stop_reason = "stop", stop
                else:
                    completion.finish_reason = str(item.finish_reason)
                    completion.stop_reason = item.stop_reason
        outputs = [self._make_output(state) for state in touched.values()]
        for state in touched.values():
            if state.finished:
                self._forget(state)
        return StepResult(outputs, stopped)

    def abort(self, request_id: str) -> RequestOutput | None:
        state = self.states.get(request_id)
        if state is None:
            return None
        for completion in state.completions:
            if completion.finish_reason is None:
                completion.finish_reason = "abort"
        output = self._make_output(state)
        self._forget(state)
        return output

    def fail(self, scheduler_id: str, message: str) -> RequestOutput | None:
        """End the request that completion `scheduler_id` belongs to (all its completions)
        because a step it was in failed; None if it is not known (already finished)."""
        entry = self._completions.get(scheduler_id)
        if entry is None:
            return None
        state = entry[0]
        for completion in state.completions:
            if completion.finish_reason is None:
                completion.finish_reason = "error"
        output = self._make_output(state)
        output.error = message
        self._forget(state)
        return output

    # ---------------------------------------------------------------- helpers

    def _add_tokens(
        self, completion: CompletionState, token_ids: list[int], entries: list[TokenLogprobs] | None
    ) -> None:
        completion.delta_token_ids.extend(token_ids)
        if completion.logprobs is None or not entries:
            return
        for entry in entries[: len(token_ids)]:
            position = self._position_logprobs(entry)
            completion.logprobs.append(position)
            completion.delta_logprobs.append(position)
            assert completion.cumulative_logprob is not None
            completion.cumulative_logprob += entry.logprobs[0]

    def _position_logprobs(self, entry: TokenLogprobs) -> PositionLogprobs:
        result: PositionLogprobs = {}
        for token_id, logprob, rank in zip(entry.token_ids, entry.logprobs, entry.ranks):
            if token_id not in result:
                text = self.tokenizer.decode([token_id], skip_special_tokens=False)
                result[token_id] = Logprob(logprob, rank, text)
        return result

    def _make_output(self, state: RequestState) -> RequestOutput:
        outputs = []
        for completion in state.completions:
            finished = completion.finish_reason is not None
            detok = completion.detokenizer
            outputs.append(
                CompletionOutput(
                    index=completion.index,
                    text=detok.text,
                    token_ids=list(detok.token_ids),
                    finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason,
                    cumulative_logprob=completion.cumulative_logprob,
                    logprobs=list(completion.logprobs) if completion.logprobs is not None else None,
                    delta_text=detok.take_delta(finished),
                    delta_token_ids=completion.delta_token_ids,
                    delta_logprobs=completion.delta_logprobs if completion.logprobs is not None else None,
                )
            )
            completion.delta_token_ids = []
            completion.delta_logprobs = []
        prompt_logprobs = None
        if state.prompt_logprobs is not None and len(state.prompt_logprobs) >= len(state.prompt_token_ids):
            prompt_logprobs = state.prompt_logprobs[: len(state.prompt_token_ids)]
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=outputs,
            finished=state.finished,
            num_cached_tokens=state.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
            embedding=state.embedding,
        )

    def _forget(self, state: RequestState) -> None:
        self.states.pop(state.request_id, None)
        for i in range(len(state.completions)):
            scheduler_id = state.request_id if i == 0 else child_request_id(state.request_id, i)
            self._completions.pop(scheduler_id, None)
