"""Core stage: admission, which requests can ever be served (refused when added, with the reason)."""

from __future__ import annotations

from pagellm.config import CacheConfig
from pagellm.config.cache import longest_request_tokens
from pagellm.errors import InvalidRequestError
from pagellm.request import Request


def check_request_fits(
    request: Request, max_model_len: int, cache_config: CacheConfig, max_step_tokens: int, max_num_seqs: int
) -> None:
    """Refuse a request that could never finish; resolve max_tokens when it is None.

    A refused request would wait forever (or be preempted forever), so refusing it at
    add time is what guarantees that an idle engine can always admit its next request.
    The KV of the last sampled token is never stored (it is never fed back), so a
    request holds at most the blocks of prompt + max_tokens - 1 tokens
    (CacheConfig.max_blocks_per_request: a sliding group only its window's, steps of at
    most max_step_tokens). Raises InvalidRequestError naming the parameter to change.
    """
    block_size = cache_config.block_size
    num_usable_blocks = cache_config.num_usable_gpu_blocks

    def blocks_for(num_tokens: int) -> int:
        return cache_config.max_blocks_per_request(num_tokens, min(num_tokens, max_step_tokens))

    n = request.sampling_params.n
    if n > max_num_seqs:  # its completions run side by side: it could never be admitted
        raise InvalidRequestError(
            f"n={n} completions run side by side, but max_num_seqs is {max_num_seqs}. "
            "Lower n or raise max_num_seqs.",
            "n",
        )
    num_prompt = request.num_prompt_tokens
    if num_prompt == 0:
        raise InvalidRequestError("The prompt is empty; it needs at least one token.", "prompt")
    if request.is_pooling and num_prompt > max_model_len:  # an embedding generates nothing
        raise InvalidRequestError(
            f"The input has {num_prompt} tokens, but this model's maximum context length is {max_model_len} "
            "tokens. Shorten the input.",
            "input",
        )
    if num_prompt >= max_model_len and not request.is_pooling:
        raise InvalidRequestError(
            f"The prompt has {num_prompt} tokens, but this model's maximum context length "
            f"is {max_model_len} tokens, which leaves no room to generate. Shorten the "
            "prompt.",
            "prompt",
        )
    cache_tokens = longest_request_tokens(cache_config, max_step_tokens, max(max_model_len, num_usable_blocks * block_size))
    num_prompt_blocks = blocks_for(num_prompt)
    if num_prompt_blocks > num_usable_blocks:
        raise InvalidRequestError(
            f"The prompt has {num_prompt} tokens and needs {num_prompt_blocks} KV cache "
            f"blocks, but the whole cache holds {num_usable_blocks} blocks of {block_size} "
            f"tokens ({cache_tokens} tokens). Shorten the prompt.",
            "prompt",
        )

    if request.is_pooling:
        return
    if request.max_tokens is None:
        request.max_tokens = max_model_len - num_prompt
    max_tokens = request.max_tokens
    if max_tokens < 1:
        raise InvalidRequestError(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
    if num_prompt + max_tokens > max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens, but "
            f"{num_prompt + max_tokens} were requested ({num_prompt} in the prompt and "
            f"{max_tokens} for the completion). Reduce max_tokens to at most "
            f"{max_model_len - num_prompt} or shorten the prompt.",
            "max_tokens",
        )
    num_max_blocks = blocks_for(num_prompt + max_tokens - 1)
    if num_max_blocks > num_usable_blocks:
        raise InvalidRequestError(
            f"The request may need {num_max_blocks} KV cache blocks ({num_prompt} prompt "
            f"tokens + max_tokens={max_tokens}), but the whole cache holds "
            f"{num_usable_blocks} blocks of {block_size} tokens ("
            f"{cache_tokens} tokens). Reduce max_tokens to at most {cache_tokens - num_prompt + 1}.",
            "max_tokens",
        )

