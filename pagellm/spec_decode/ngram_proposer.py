"""Spec decode stage: n-gram prompt lookup (vLLM's "ngram" method).

The proposal for a request is what followed the latest earlier occurrence of its last n
tokens in its own prompt and output, trying the longest n first (prompt_lookup_max down
to prompt_lookup_min): text that quotes its input (edits, summaries, answers grounded in
a passage) repeats long runs of it, and those runs are then proposed whole. Pure Python.
"""

from __future__ import annotations

from collections.abc import Sequence


def propose_ngram(
    token_ids: Sequence[int], num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int
) -> list[int]:
    """Up to `num_speculative_tokens` tokens that followed the latest earlier match of the
    sequence's last n tokens (n from prompt_lookup_max down to prompt_lookup_min); [] when
    nothing matches."""
    length = len(token_ids)
    for n in range(min(prompt_lookup_max, length - 1), prompt_lookup_min - 1, -1):
        suffix = list(token_ids[length - n :])
        # The latest start before the suffix itself whose n tokens equal the suffix.
        for start in range(length - n - 1, -1, -1):
            if token_ids[start] == suffix[0] and list(token_ids[start : start + n]) == suffix:
                follow = token_ids[start + n : start + n + num_speculative_tokens]
                if follow:
                    return list(follow)
    return []
