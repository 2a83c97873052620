"""Worker stage: execute one SchedulerOutput on the model and sample next tokens.

The runner keeps, per running request, the token ids and block table the scheduler told
it about, turns each step into flattened model inputs, runs the model, samples the rows
that need a next token and reports them in a ModelRunnerOutput. It also performs the
swap copies between the device KV cache and the host KV cache.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pagellm.core.scheduler_output import ModelRunnerOutput, NewRequestData, SchedulerOutput
from pagellm.model.llama import LlamaForCausalLM
from pagellm.sample.sampler import Sampler, SamplingBatch
from pagellm.sampling_params import SamplingParams
from pagellm.worker.kv_cache import allocate_kv_caches
from pagellm.worker.model_inputs import ScheduledSequence, prepare_model_inputs

logger = logging.getLogger(__name__)


@dataclass
class RunnerRequestState:
    """What the runner remembers of a request between steps."""

    token_ids: list[int]  # prompt + outputs so far
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        block_size: int,
        num_device_blocks: int,
        num_host_blocks: int,
        kv_cache_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        config = model.config
        self.kv_caches = allocate_kv_caches(config, num_device_blocks, block_size, kv_cache_dtype, device)
        self.host_kv_caches = (
            allocate_kv_caches(
                config,
                num_host_blocks,
                block_size,
                kv_cache_dtype,
                "cpu",
                pin_memory=device.type == "cuda",
            )
            if num_host_blocks > 0
            else []
        )
        self.sampler = Sampler()
        self.requests: dict[str, RunnerRequestState] = {}
        # Seeded generators outlive preemption so a request's draws stay reproducible.
        self.generators: dict[str, torch.Generator] = {}

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
            self.generators.pop(req_id, None)
        for req_id in scheduler_output.preempted_req_ids:
            self.requests.pop(req_id, None)
        self._swap(scheduler_output)
        for new in scheduler_output.scheduled_new_reqs:
            self._add_request(new)
        for cached in scheduler_output.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

        req_ids = list(scheduler_output.num_scheduled_tokens)
        if not req_ids:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids={})
        sequences: list[ScheduledSequence] = []
        sampled_req_ids: list[str] = []
        for req_id in req_ids:
            state = self.requests[req_id]
            start = state.num_computed_tokens
            end = start + scheduler_output.num_scheduled_tokens[req_id]
            needs_token = end == len(state.token_ids)
            sequences.append(
                ScheduledSequence(state.token_ids[start:end], start, state.block_ids, needs_token)
            )
            if needs_token:
                sampled_req_ids.append(req_id)

        inputs = prepare_model_inputs(sequences, self.block_size, self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata)
        sampled: dict[str, list[int]] = {req_id: [] for req_id in req_ids}
        if sampled_req_ids:
            logits = self.model.compute_logits(hidden[inputs.logits_indices])
            tokens = self.sampler(logits, self._sampling_batch(sampled_req_ids))
            for req_id, token in zip(sampled_req_ids, tokens, strict=True):
                self.requests[req_id].token_ids.append(token)
                sampled[req_id] = [token]
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)

    def _add_request(self, new: NewRequestData) -> None:
        self.requests[new.req_id] = RunnerRequestState(
            token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
            num_prompt_tokens=len(new.prompt_token_ids),
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            sampling_params=new.sampling_params,
            eos_token_ids=new.eos_token_ids,
        )
        seed = new.sampling_params.seed
        if seed is not None and new.req_id not in self.generators:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed)
            self.generators[new.req_id] = generator

    def _sampling_batch(self, req_ids: list[str]) -> SamplingBatch:
        params, generators, banned = [], [], []
        for req_id in req_ids:
            state = self.requests[req_id]
            sp = state.sampling_params
            params.append(sp)
            generators.append(self.generators.get(req_id))
            if state.num_output_tokens < sp.min_tokens:
                held_back = set(sp.stop_token_ids)
                if not sp.ignore_eos:
                    held_back |= state.eos_token_ids
                banned.append(sorted(held_back))
            else:
                banned.append([])
        return SamplingBatch(params=params, generators=generators, banned_token_ids=banned)

    def _swap(self, scheduler_output: SchedulerOutput) -> None:
        """Copy whole blocks between device and host caches, every layer, K and V."""
        if scheduler_output.blocks_to_swap_out:
            src, dst = zip(*scheduler_output.blocks_to_swap_out, strict=True)
            self._copy_blocks(self.kv_caches, self.host_kv_caches, src, dst)
        if scheduler_output.blocks_to_swap_in:
            src, dst = zip(*scheduler_output.blocks_to_swap_in, strict=True)
            self._copy_blocks(self.host_kv_caches, self.kv_caches, src, dst)
        if scheduler_output.blocks_to_copy:
            src, dst = zip(*scheduler_output.blocks_to_copy, strict=True)
            self._copy_blocks(self.kv_caches, self.kv_caches, src, dst)

    @staticmethod
    def _copy_blocks(
        source: list[torch.Tensor],
        target: list[torch.Tensor],
        source_ids: tuple[int, ...],
        target_ids: tuple[int, ...],
    ) -> None:
        src_index = torch.tensor(source_ids, device=source[0].device)
        dst_index = torch.tensor(target_ids, device=target[0].device)
        for src_layer, dst_layer in zip(source, target, strict=True):
            # [2, n, block_size, kv_heads, head_dim]
            blocks = src_layer.index_select(1, src_index).to(dst_layer.device, non_blocking=True)
            dst_layer.index_copy_(1, dst_index, blocks)
