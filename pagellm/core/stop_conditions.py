"""Core stage: when a request stops, decided as each sampled token is appended."""

from __future__ import annotations

from pagellm.request import Request, RequestStatus


def check_stop(request: Request, token_id: int, max_model_len: int) -> RequestStatus | None:
    """The finished status caused by the just-appended `token_id`, or None.

    Order: stop_token_ids, then EOS (unless ignore_eos), neither before min_tokens
    outputs; then max_tokens, then max_model_len. A stop token is recorded in
    request.stop_reason; EOS leaves it None (OpenAI/vLLM convention).
    """
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if not params.ignore_eos and token_id in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
    assert request.max_tokens is not None, "resolved by check_request_fits"
    if request.num_output_tokens >= request.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    if request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
