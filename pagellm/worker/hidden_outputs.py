"""Worker stage: what a step's hidden states give besides the next token.

Prompt logprobs (each prompt token's log-probability given the tokens before it, with the
top k, chunk by chunk as the prompt is computed) and embeddings (the final hidden states
pooled as an embedding or classification request asks). The model runner calls both after
every forward pass; they read its per-request state and write into the step's output.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from pagellm.core.scheduler_output import ModelRunnerOutput, TokenLogprobs
from pagellm.model.llama import LlamaForCausalLM
from pagellm.worker.model_inputs import ScheduledSequence
from pagellm.worker.request_state import RunnerRequestState


def compute_prompt_logprobs(
    model: LlamaForCausalLM,
    requests: Mapping[str, RunnerRequestState],
    req_ids: list[str],
    sequences: list[ScheduledSequence],
    starts: list[int],
    hidden: torch.Tensor,
    output: ModelRunnerOutput,
    is_driver: bool,
) -> None:
    """Logprobs of each prompt token given the tokens before it, for this step's chunk.
    Every rank computes the logits (the LM head is sharded under tensor parallelism);
    only the driver reports them."""
    for index, (req_id, seq) in enumerate(zip(req_ids, sequences, strict=True)):
        state = requests[req_id]
        k = state.sampling_params.prompt_logprobs
        if k is None:
            continue
        # Row i predicts the token at position start + i + 1, while that is a prompt token.
        count = min(len(seq.token_ids), state.num_prompt_tokens - 1 - seq.start_position)
        if count <= 0:
            continue
        first = starts[index]
        logprobs = model.compute_logits(hidden[first : first + count]).float()
        if not is_driver:
            continue
        logprobs = logprobs.log_softmax(dim=-1)
        positions = range(seq.start_position + 1, seq.start_position + 1 + count)
        targets = torch.tensor([state.token_ids[p] for p in positions], device=hidden.device)
        target_logprobs = logprobs.gather(1, targets.unsqueeze(1))
        target_ranks = (logprobs > target_logprobs).sum(dim=1) + 1
        top_values, top_ids = logprobs.topk(k, dim=1) if k else (None, None)
        entries = []
        for i in range(count):
            ids, values, ranks = [int(targets[i])], [float(target_logprobs[i, 0])], [int(target_ranks[i])]
            if k:
                assert top_ids is not None and top_values is not None
                ids += top_ids[i].tolist()
                values += top_values[i].tolist()
                ranks += list(range(1, k + 1))
            entries.append(TokenLogprobs(ids, values, ranks))
        if output.prompt_logprobs is None:
            output.prompt_logprobs = {}
        output.prompt_logprobs[req_id] = entries


def pool_hidden_states(
    model: LlamaForCausalLM,
    requests: Mapping[str, RunnerRequestState],
    partials: dict[str, torch.Tensor],
    req_ids: list[str],
    sequences: list[ScheduledSequence],
    starts: list[int],
    hidden: torch.Tensor,
    output: ModelRunnerOutput,
) -> None:
    """Embedding requests: the final hidden states (after the model's last norm) of this
    step's positions pooled as each asks; mean and CLS pooling keep their partial result in
    `partials` across chunks. A request whose prompt is now complete gets its embedding,
    shortened to `dimensions` and L2-normalised where asked (a classifier: its head's logits)."""
    for index, (req_id, seq) in enumerate(zip(req_ids, sequences, strict=True)):
        params = requests[req_id].pooling_params
        if params is None:
            continue
        rows = hidden[starts[index] : starts[index + 1]]
        kind = params.pooling_type
        if kind == "mean":
            chunk = rows.float().sum(dim=0)
            partial = partials.get(req_id)
            partials[req_id] = chunk if partial is None else partial + chunk
        elif kind == "cls" and seq.start_position == 0:
            partials[req_id] = rows[0].float()
        if not seq.needs_logits:
            continue
        if params.task == "classify":  # the head over the last token's state: its logits
            output.pooled[req_id] = model.classify(rows[-1]).cpu().tolist()
            continue
        if kind == "last":
            vector = rows[-1].float()
        elif kind == "mean":
            vector = partials.pop(req_id) / requests[req_id].num_prompt_tokens
        else:
            vector = partials.pop(req_id)
        if params.dimensions is not None:
            vector = vector[: params.dimensions]
        if params.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        output.pooled[req_id] = vector.cpu().tolist()
