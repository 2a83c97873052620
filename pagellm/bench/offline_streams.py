"""Bench stage: the offline engine's token timeline for a set of requests, as serve records.

`measure_offline` adds every request to an LLMEngine at once and steps it to the end,
noting when each request's tokens come out of a step. The result is the same
RequestRecord list that `pagellm bench serve` fills from a server's stream, so one
`summarize()` gives both sides' TTFT, ITL and output tok/s by the same definitions: the
difference between the two is what the server adds.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from pagellm.bench.serve_metrics import RequestRecord
from pagellm.engine.llm_engine import LLMEngine
from pagellm.sampling_params import SamplingParams


@dataclass(frozen=True)
class OfflineRun:
    records: list[RequestRecord]
    duration_s: float  # first add to the last request's end
    step_seconds: list[float]  # wall time of each engine step

    @property
    def num_steps(self) -> int:
        return len(self.step_seconds)


def measure_offline(
    engine: LLMEngine,
    prompts: Sequence[list[int]],
    output_lens: Sequence[int],
    request_id_prefix: str = "offline",
) -> OfflineRun:
    """Run `prompts` (token ids) greedily for exactly `output_lens` tokens each."""
    if len(prompts) != len(output_lens):
        raise ValueError(f"{len(prompts)} prompts but {len(output_lens)} output lengths")
    records = [
        RequestRecord(index=i, prompt_len=len(p), expected_output_len=n, scheduled_s=0.0)
        for i, (p, n) in enumerate(zip(prompts, output_lens))
    ]
    by_id: dict[str, RequestRecord] = {}
    start = time.perf_counter()
    for record, prompt in zip(records, prompts):
        request_id = f"{request_id_prefix}-{record.index}"
        params = SamplingParams(temperature=0.0, max_tokens=record.expected_output_len, ignore_eos=True)
        engine.add_request(request_id, prompt, params)
        by_id[request_id] = record
    step_seconds: list[float] = []
    while engine.has_unfinished_requests():
        step_start = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        step_seconds.append(now - step_start)
        for output in outputs:
            record = by_id[output.request_id]
            completion = output.outputs[0]
            if completion.delta_token_ids:
                record.chunk_times_s.append(now - start)
            if output.finished:
                record.end_s = now - start
                record.output_tokens = len(completion.token_ids)
                record.success = completion.finish_reason == "length"
                if not record.success:
                    record.error = f"finished early ({completion.finish_reason})"
    for record in records:
        record.prompt_tokens = record.prompt_len
        if record.chunk_times_s:
            record.ttft_s = record.chunk_times_s[0]
    duration = max((r.end_s for r in records), default=0.0)
    return OfflineRun(records, duration, step_seconds)
