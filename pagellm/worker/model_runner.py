"""Worker stage: execute one SchedulerOutput on the model and sample next tokens.

The runner keeps, per running request, the token ids and block table the scheduler told
it about, turns each step into flattened model inputs, runs the model, samples the rows
that need a next token and reports them in a ModelRunnerOutput. It also performs the
block copies: swaps between the device and host KV caches, and copy-on-write of forked
completions.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from pagellm.attention.kv_cache_dtype import copyable
from pagellm.core.scheduler_output import ModelRunnerOutput, NewRequestData, SchedulerOutput
from pagellm.lora.slots import LoRAManager, LoRAMapping
from pagellm.model.llama import LlamaForCausalLM
from pagellm.request import child_request_id
from pagellm.sample.penalties import PenaltyState
from pagellm.sample.sampler import Sampler, SamplingBatch, held_back_ids
from pagellm.spec_decode.draft_model import DraftModelProposer, Drafts
from pagellm.structured.grammar_compiler import GrammarCompiler
from pagellm.structured.token_masks import MaskTimer, apply_masks, fill_masks
from pagellm.worker.fault_injection import FaultInjector
from pagellm.worker.hidden_outputs import compute_prompt_logprobs, pool_hidden_states
from pagellm.config.kv_layout import kv_cache_layout
from pagellm.worker.kv_cache import allocate_kv_caches, distinct_tensors
from pagellm.worker.kv_tier_store import TierStore
from pagellm.worker.kv_tier_transfer import KVTierTransfer
from pagellm.worker.model_inputs import ScheduledSequence
from pagellm.worker.recurrent_state import allocate_linear_states, fill_state_slots
from pagellm.worker.request_state import RunnerRequestState
from pagellm.worker.spec_verification import SpeculativeVerifier
from pagellm.worker.step_paths import StepInputs, StepPaths
from pagellm.worker.step_paths.cuda_graphs import Capture, DecodeGraphs, cuda_graph_capture

logger = logging.getLogger(__name__)


@dataclass
class _SampleRow:
    """One row of the step's sampling batch."""

    req_id: str  # who receives the token (a forked child for fork rows)
    owner_id: str  # the request whose logits and state the row uses
    hidden_row: int  # row of the flat batch whose hidden state gives the logits


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        block_size: int,
        num_device_blocks: int,
        num_host_blocks: int,
        kv_cache_dtype: torch.dtype,
        device: torch.device,
        is_driver: bool = True,
        grammars: GrammarCompiler | None = None,
        draft: DraftModelProposer | None = None,
        lora_manager: LoRAManager | None = None,
        kv_tier_store: TierStore | None = None,
        kv_tier_host_bytes: int = 0,
        num_state_slots: int = 0,
        num_state_snapshots: int = 0,
        num_host_state_slots: int = 0,
    ) -> None:
        self.model = model
        # With tensor parallelism only the driver (rank 0) samples; the other ranks make
        # the same logits calls (collectives) and learn the tokens from the driver.
        self.is_driver = is_driver
        self.block_size = block_size
        self.device = device
        config = model.config
        self.kv_caches = allocate_kv_caches(
            config, num_device_blocks, block_size, kv_cache_dtype, device
        )
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
        # A hybrid model's recurrent state: a slot per running request in each linear layer.
        self.linear_states = allocate_linear_states(config, num_state_slots, device)
        self.snapshot_states = allocate_linear_states(config, num_state_snapshots, device)  # for prefix hits
        self.host_states = allocate_linear_states(config, num_host_state_slots, "cpu")  # swapped-out requests'
        self._state_saves: dict[str, list[tuple[int, int]]] = {}  # the step's snapshots to write
        # The prefix cache's second tier: its writes and loads (worker/kv_tier_transfer.py).
        self.kv_tier = (
            KVTierTransfer(
                kv_tier_store, distinct_tensors(self.kv_caches), kv_tier_host_bytes, self.linear_states, self.snapshot_states
            )
            if kv_tier_store is not None
            else None
        )
        self.sampler = Sampler()
        self.penalties = PenaltyState(model.vocab_size, device)
        self.requests: dict[str, RunnerRequestState] = {}
        # Embedding requests pooling over several positions (mean, CLS): what their chunks
        # so far contributed (float32 [hidden]). Kept across a swap preemption, whose
        # positions are not computed again; reset when a recompute starts over.
        self.pooling_partials: dict[str, torch.Tensor] = {}
        # Seeded generators outlive preemption so a request's draws stay reproducible.
        self.generators: dict[str, torch.Generator] = {}
        self.decode_graphs: DecodeGraphs | None = None
        # How a step runs (worker/step_paths/): the first of these that applies to it.
        self.step_paths = StepPaths.for_model(model)
        # --enable-lora: the adapters' slots (the worker handed them to the layers).
        self.lora_manager = lora_manager
        self._lora_counts_reported = (0, 0)  # the manager's loads and evictions already reported
        # Structured outputs: the engine's compiler, on the driver (the rank that samples).
        self.grammars = grammars
        self.mask_timer = MaskTimer()  # time spent filling and applying masks
        # Speculative decoding with a draft model (its own weights and KV cache).
        self.draft = draft
        # Tests only: steps made to fail on purpose (worker/fault_injection.py).
        self.faults = FaultInjector.from_env()
        self.verifier = SpeculativeVerifier(
            compute_logits=model.compute_logits,
            requests=self.requests,
            sampler=self.sampler,
            penalties=self.penalties,
            generators=self.generators,
            device=device,
            is_driver=is_driver,
        )

    def capture_decode_graphs(
        self, sizes: list[int], max_model_len: int, capture: Capture | None = None
    ) -> None:
        """Capture the decode forward at these batch sizes (CUDA graphs unless `capture`
        says otherwise); later decode-only steps that fit replay them. A model with several
        KV cache groups runs eagerly (the captured step has one group's tables)."""
        if len(kv_cache_layout(self.model.config).groups) > 1:
            logger.info("no decode graphs: the model has several KV cache groups (sliding-window layers)")
            return
        if self.linear_states:
            logger.info("no decode graphs: the model has linear-attention layers (recurrent state)")
            return
        start = time.perf_counter()
        self.decode_graphs = DecodeGraphs(
            self.model, self.kv_caches, sizes, max_model_len, self.block_size, self.device,
            capture or cuda_graph_capture,
        )  # fmt: skip
        self.step_paths = self.step_paths.with_decode_graphs(self.decode_graphs)
        logger.info(
            "captured decode graphs for %d batch sizes (1 to %d) in %.1fs",
            len(sizes), max(sizes), time.perf_counter() - start,
        )  # fmt: skip

    def append_sampled(self, sampled_token_ids: dict[str, list[int]]) -> None:
        """A non-driver rank: the tokens the driver sampled last step, before the next."""
        for req_id, tokens in sampled_token_ids.items():
            state = self.requests.get(req_id)
            if state is not None:  # a request that finished since is already gone
                state.token_ids.extend(tokens)

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        output = self._execute(scheduler_output)
        manager = self.lora_manager
        if manager is not None:  # the step's adapter loads and evictions (the engine sums them)
            loads, evictions = self._lora_counts_reported
            output.num_lora_loads, output.num_lora_evictions = manager.num_loads - loads, manager.num_evictions - evictions
            self._lora_counts_reported = (manager.num_loads, manager.num_evictions)
        return output

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in scheduler_output.finished_req_ids:
            self._drop(req_id)
            self.generators.pop(req_id, None)
            self.pooling_partials.pop(req_id, None)
        for req_id in scheduler_output.preempted_req_ids:
            self._drop(req_id)
        if self.kv_tier is None:
            self._copy_blocks_for(scheduler_output)
            return self._run_step(scheduler_output)
        # Blocks to offload may be reused by this step's copies or loads: out first. Loads
        # start after the copies (a block a swap-out reads may be a load's target) and
        # run beside the forward pass, which reads none of their blocks.
        self.kv_tier.offload(
            scheduler_output.blocks_to_offload, scheduler_output.tier_deletions, scheduler_output.states_to_offload
        )
        self._copy_blocks_for(scheduler_output)
        loading = self.kv_tier.start_loads(scheduler_output.blocks_to_load, scheduler_output.states_to_load)
        try:
            output = self._run_step(scheduler_output)
        finally:
            if loading is not None:
                loading.exception()  # never leave a load writing into the cache after the step
        output.kv_tier = self.kv_tier.report(loading)
        return output

    def _run_step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        fill_state_slots(self.linear_states, self.snapshot_states, self.host_states, scheduler_output)
        self._state_saves = scheduler_output.state_saves
        for new in scheduler_output.scheduled_new_reqs:
            self._add_request(new)
        for cached in scheduler_output.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            for table, new_ids in zip(state.block_ids, cached.new_block_ids, strict=True):
                if cached.num_kept_block_ids is not None:
                    del table[cached.num_kept_block_ids :]
                table.extend(new_ids)
            state.num_computed_tokens = cached.num_computed_tokens

        req_ids = list(scheduler_output.num_scheduled_tokens)
        if not req_ids:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids={})
        if self.lora_manager is not None:  # each adapter's rows in one range (stable: the base model's first)
            req_ids.sort(key=lambda req_id: self.requests[req_id].lora_int_id)
        if scheduler_output.decode_steps:
            if self.faults is not None:
                self.faults.check(scheduler_output)
            return self._run_decode_steps(req_ids, scheduler_output.decode_steps)
        proposals = scheduler_output.scheduled_spec_decode_tokens
        drafted: dict[str, Drafts] = {}
        if proposals and self.draft is not None:
            drafted = self.verifier.draft(proposals, self.draft)
            proposals = {req_id: result.token_ids for req_id, result in drafted.items()}
        sequences: list[ScheduledSequence] = []
        for req_id in req_ids:
            state = self.requests[req_id]
            start = state.num_computed_tokens
            proposal = proposals.get(req_id, [])
            # A speculating request computes its next token and the proposed ones after it.
            end = start + scheduler_output.num_scheduled_tokens[req_id] - len(proposal)
            sequences.append(
                ScheduledSequence(
                    state.token_ids[start:end] + proposal, start, state.block_ids, end == len(state.token_ids),
                    state.state_slot, tuple(self._state_saves.get(req_id, ())),
                )
            )
        if self.faults is not None:
            self.faults.check(scheduler_output)
        hidden, starts = self._forward(req_ids, sequences)
        output = ModelRunnerOutput(
            req_ids=req_ids, sampled_token_ids={req_id: [] for req_id in req_ids}
        )
        compute_prompt_logprobs(self.model, self.requests, req_ids, sequences, starts, hidden, output, self.is_driver)
        if self.is_driver:
            pool_hidden_states(self.model, self.requests, self.pooling_partials, req_ids, sequences, starts, hidden, output)
        if proposals:
            self.verifier.verify(req_ids, proposals, starts, hidden, output, drafted, self.draft)
        rows = self._sample_rows(req_ids, sequences, starts, proposals)
        if rows:
            self._sample(rows, hidden, output)
        output.mask_seconds = self.mask_timer.take()
        return output

    def _forward(self, req_ids: list[str], sequences: list[ScheduledSequence]) -> tuple[torch.Tensor, list[int]]:
        """The model over the step's sequences: hidden states and each sequence's first row."""
        adapters = self._activate_adapters(req_ids, sequences)
        step = StepInputs(
            sequences, self.kv_caches, self.block_size, self.device, has_adapters=adapters,
            linear_states=self.linear_states, snapshot_states=self.snapshot_states,
        )  # fmt: skip
        try:
            hidden = self.step_paths.forward(step)
        finally:
            if adapters:
                self.lora_manager.set_mapping(None)
        return hidden, step.query_starts

    def _run_decode_steps(self, req_ids: list[str], steps: dict[str, int]) -> ModelRunnerOutput:
        """Multi-step decoding (core/multi_step.py): each request computes its last token,
        samples the next and feeds it back, `steps[req_id]` times (1 where absent). Every
        sample goes through _sample as in separate steps (penalties, seeds, logprobs); stops
        are the scheduler's to check, so a request runs its steps whatever it samples."""
        output = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids={req_id: [] for req_id in req_ids})
        for step in range(max(steps.values())):
            active = [req_id for req_id in req_ids if steps.get(req_id, 1) > step]
            states = [self.requests[req_id] for req_id in active]
            sequences = [
                ScheduledSequence([state.token_ids[-1]], len(state.token_ids) - 1, state.block_ids, True, state.state_slot)
                for state in states
            ]
            hidden, _ = self._forward(active, sequences)
            sampled = ModelRunnerOutput(req_ids=active, sampled_token_ids={})
            self._sample([_SampleRow(req_id, req_id, row) for row, req_id in enumerate(active)], hidden, sampled)
            for req_id in active:
                output.sampled_token_ids[req_id].extend(sampled.sampled_token_ids[req_id])
            for req_id, entries in (sampled.logprobs or {}).items():
                output.logprobs = output.logprobs if output.logprobs is not None else {}
                output.logprobs.setdefault(req_id, []).extend(entries)
        output.mask_seconds = self.mask_timer.take()
        return output

    def _activate_adapters(self, req_ids: list[str], sequences: list[ScheduledSequence]) -> bool:
        """With adapters in the step: make them resident and tell the model which rows
        run under which slot. False when every row is the base model's."""
        manager = self.lora_manager
        if manager is None:
            return False
        requests = {}
        ranges: dict[int, tuple[int, int]] = {}
        row = 0
        for req_id, seq in zip(req_ids, sequences, strict=True):
            lora = self.requests[req_id].lora_request
            end = row + len(seq.token_ids)
            if lora is not None:
                requests[lora.lora_int_id] = lora
                first, last = ranges.get(lora.lora_int_id, (row, row))
                assert last == row, "an adapter's requests are next to each other (execute_model orders them)"
                ranges[lora.lora_int_id] = (first, end)
            row = end
        if not requests:
            return False
        slots = manager.activate(requests)
        manager.set_mapping(LoRAMapping(tuple((slots[i], first, end) for i, (first, end) in ranges.items())))
        return True

    # ------------------------------------------------------------- sampling

    def _sample_rows(
        self, req_ids: list[str], sequences: list[ScheduledSequence], starts: list[int], proposals: dict[str, list[int]]
    ) -> list[_SampleRow]:
        rows: list[_SampleRow] = []
        for index, (req_id, seq) in enumerate(zip(req_ids, sequences, strict=True)):
            if not seq.needs_logits or req_id in proposals or self.requests[req_id].pooling_params is not None:
                continue  # speculating requests are verified, embedding requests pooled, not sampled
            last_row = starts[index + 1] - 1
            rows.append(_SampleRow(req_id, req_id, last_row))
            state = self.requests[req_id]
            # n > 1: the other completions draw their first token from the same logits.
            for fork in range(1, state.num_pending_forks + 1):
                rows.append(_SampleRow(child_request_id(req_id, fork), req_id, last_row))
        return rows

    def _sample(self, rows: list[_SampleRow], hidden: torch.Tensor, output: ModelRunnerOutput) -> None:
        index = torch.tensor([row.hidden_row for row in rows], device=self.device)
        logits = self.model.compute_logits(hidden[index])
        if not self.is_driver:
            for row in rows:
                if row.req_id != row.owner_id:
                    self.requests[row.owner_id].num_pending_forks = 0
            return
        self._mask(rows, logits)
        result = self.sampler(logits, self._sampling_batch(rows))
        owners: list[str] = []
        owner_tokens: list[int] = []
        for row, token, logprobs in zip(rows, result.token_ids, result.logprobs, strict=True):
            if logprobs is not None:
                if output.logprobs is None:
                    output.logprobs = {}
                output.logprobs[row.req_id] = [logprobs]
            if row.req_id == row.owner_id:
                state = self.requests[row.req_id]
                state.token_ids.append(token)
                if state.matcher is not None and not state.matcher.consume_token(token):
                    logger.warning("request %s: the constraint refused token %d", row.req_id, token)
                output.sampled_token_ids[row.req_id] = [token]
                owners.append(row.req_id)
                owner_tokens.append(token)
            else:
                output.forked_token_ids.setdefault(row.owner_id, []).append(token)
                self.requests[row.owner_id].num_pending_forks = 0
        self.penalties.record(owners, owner_tokens)

    def _mask(self, rows: list[_SampleRow], logits: torch.Tensor) -> None:
        """Constrained rows keep only their grammar's allowed tokens (a fork row shares its
        owner's mask: nothing is consumed before the first token).

        Filled here, after the forward, not beside it on another thread: on the CPU that
        thread's turns at the GIL slowed the model's own Python between its operations
        far more than the ~0.3 ms per 32 rows the filling costs (measured: a constrained
        run at 0.62x of its unconstrained twin with the thread, 0.92-0.95x without)."""
        first_row: dict[str, int] = {}  # owner -> the row its matcher fills
        copies: list[tuple[int, int]] = []  # (fork row, the row whose mask it shares)
        for position, row in enumerate(rows):
            if self.requests[row.owner_id].matcher is None:
                continue
            if row.owner_id in first_row:
                copies.append((position, first_row[row.owner_id]))
            else:
                first_row[row.owner_id] = position
        if not first_row:
            return
        with self.mask_timer.time():
            matchers = [(self.requests[owner].matcher, position) for owner, position in first_row.items()]
            bitmask = fill_masks(matchers, len(rows), logits.shape[1])
            for position, source in copies:
                bitmask[position] = bitmask[source]
            apply_masks(logits, bitmask, sorted([*first_row.values(), *(p for p, _ in copies)]))

    def _sampling_batch(self, rows: list[_SampleRow]) -> SamplingBatch:
        params, generators, banned, penalty_rows, penalty_owners = [], [], [], [], []
        for position, row in enumerate(rows):
            state = self.requests[row.owner_id]
            sp = state.sampling_params
            params.append(sp)
            if row.req_id != row.owner_id and sp.seed is not None:
                self._ensure_generator(row.req_id, sp.seed + int(row.req_id.rsplit("#", 1)[1]))
            generators.append(self.generators.get(row.req_id))
            banned.append(held_back_ids(sp, state.eos_token_ids) if state.num_output_tokens < sp.min_tokens else [])
            if self.penalties.has(row.owner_id):
                penalty_rows.append(position)
                penalty_owners.append(row.owner_id)
        batch = SamplingBatch(params=params, generators=generators, banned_token_ids=banned)
        if penalty_rows:
            index = self.penalties.rows_of(penalty_owners)
            batch.penalty_rows = penalty_rows
            batch.output_counts = self.penalties.output_counts[index]
            batch.prompt_mask = self.penalties.prompt_mask[index]
        return batch

    # ---------------------------------------------------------------- state

    def _add_request(self, new: NewRequestData) -> None:
        state = RunnerRequestState(
            token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
            num_prompt_tokens=len(new.prompt_token_ids),
            block_ids=[list(table) for table in new.block_ids],
            num_computed_tokens=new.num_computed_tokens,
            sampling_params=new.sampling_params,
            eos_token_ids=new.eos_token_ids,
            num_pending_forks=new.num_pending_forks,
            pooling_params=new.pooling_params,
            lora_request=new.lora_request,
            state_slot=new.state_slot,
        )
        self.requests[new.req_id] = state
        if new.num_computed_tokens == 0:  # (re)started from the first position
            self.pooling_partials.pop(new.req_id, None)
        if self.draft is not None:
            self.draft.drop(new.req_id)  # its draft K/V is computed afresh
        constraint = new.sampling_params.structured_outputs
        if constraint is not None and self.is_driver:
            assert self.grammars is not None, "the engine compiles constraints"
            state.matcher = self.grammars.compile(constraint).new_matcher()
            # A recomputed, swapped-in or forked request replays what it already produced.
            if new.output_token_ids and not state.matcher.consume_tokens(list(new.output_token_ids)):
                logger.warning("request %s: its earlier tokens do not fit its constraint", new.req_id)
        if new.sampling_params.seed is not None:
            self._ensure_generator(new.req_id, new.sampling_params.seed)
        if new.sampling_params.has_penalties:
            self.penalties.remove(new.req_id)
            self.penalties.add(new.req_id, new.prompt_token_ids, new.output_token_ids)

    def _ensure_generator(self, req_id: str, seed: int) -> None:
        if req_id not in self.generators:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed)
            self.generators[req_id] = generator

    def _drop(self, req_id: str) -> None:
        self.requests.pop(req_id, None)
        self.penalties.remove(req_id)
        if self.draft is not None:
            self.draft.drop(req_id)

    # ---------------------------------------------------------------- copies

    def _copy_blocks_for(self, scheduler_output: SchedulerOutput) -> None:
        """Swap-outs, then copy-on-write copies, then swap-ins (see SchedulerOutput)."""
        if scheduler_output.blocks_to_swap_out:
            src, dst = zip(*scheduler_output.blocks_to_swap_out, strict=True)
            _copy_blocks(self.kv_caches, self.host_kv_caches, src, dst)
        if scheduler_output.blocks_to_copy:
            src, dst = zip(*scheduler_output.blocks_to_copy, strict=True)
            _copy_blocks(self.kv_caches, self.kv_caches, src, dst)
        if scheduler_output.blocks_to_swap_in:
            src, dst = zip(*scheduler_output.blocks_to_swap_in, strict=True)
            _copy_blocks(self.host_kv_caches, self.kv_caches, src, dst)


def _copy_blocks(
    source: list[torch.Tensor],
    target: list[torch.Tensor],
    source_ids: tuple[int, ...],
    target_ids: tuple[int, ...],
) -> None:
    """Copy whole blocks (every cache tensor, K and V) from one cache to another."""
    src_index = torch.tensor(source_ids, device=source[0].device)
    dst_index = torch.tensor(target_ids, device=target[0].device)
    for src_layer, dst_layer in zip(distinct_tensors(source), distinct_tensors(target), strict=True):
        # [2, n, block_size, kv_heads, head_dim]; fp8 caches as their bytes.
        blocks = copyable(src_layer).index_select(1, src_index).to(dst_layer.device, non_blocking=True)
        copyable(dst_layer).index_copy_(1, dst_index, blocks)
