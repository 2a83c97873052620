"""The default path (bfloat16 through the native CPU kernels) judged against HF float32.

The test suite pins float32 (tests/conftest.py), the path that must equal HF transformers
token for token. What users get by default on an x86-64 CPU (AVX2 and up) is bfloat16 through
pagellm/kernels/ (the bf16 linear kernels, the one-call decode layer for decode steps of
<= fused_decode.MAX_ROWS requests, the native layer ops for every other step). bf16 cannot
reproduce float32's tokens exactly, so it is judged the way a lower precision can be:

- teacher-forced top-1 agreement: HF float32 reads each request's prompt + the tokens
  pagellm emitted, once; at every generated position HF's argmax should be the emitted
  token, and where it is not, HF's own logits must show a near-tie (`near_tie_bound`);
- logits: pagellm's log-probabilities (full vocabulary at the prefill's last position,
  the emitted token's at every generated position) against HF float32's, each within
  `logit_error_bound` (worst case) and together within `logit_rms_bound` (root mean
  square), both derived from bf16 rounding;
- scheduling facts (preemptions, swaps, prefix-cache hits, tokens computed) must be the
  same as the same scenario in float32: precision must not change the schedule.

The helpers take the model, the dtype and engine arguments, so the same scenarios can run
on other models (quantized GGUF files) with an HF reference loaded from the same weights.
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from engine_checks import assert_engine_drained
from hf_models import make_tiny_hf_checkpoint
from safetensors.torch import load_file, save_file

from pagellm import LLM, SamplingParams

# bf16 keeps 8 significant bits: neighbouring values are 2^-8 apart (relative), so one
# round-to-nearest is off by at most half of that.
BF16_SPACING = 2.0**-8
BF16_ROUNDING = BF16_SPACING / 2

# Where one decoder layer's value is rounded to bf16 on its way to the next layer, in
# pagellm's bf16 path (csrc/layer_rows.h: the residual stream, rotary and the activation's
# inputs stay float32): the weights, once each (qkv, o, gate_up, down); the matmul inputs
# and the cache (input norm, q, k, v, attention output, post-attention norm, silu x up);
# and, where the measured choice takes oneDNN, its four bf16 outputs.
ROUNDINGS_PER_LAYER = 4 + 7 + 4
# Outside the layers: the embedding, the final norm and the LM head weight (the logits
# are float32).
ROUNDINGS_OUTSIDE_LAYERS = 3

# Teacher-forced top-1 agreement a scenario must reach. Independent of pagellm: HF's own
# bf16 run of the test model agrees with HF float32 at ~99% of greedy positions (a random
# model's 256 logits are close to Gaussian, so ~1% of positions have a top-two gap below
# bf16's logit error); pagellm's bf16 path measures 97.9-99.3% across the scenarios. 97%
# leaves room for the statistics of a few hundred positions, while a real fault (noise of
# 1% in the linear layers, a stale swapped-in or copy-on-write block) drops agreement
# below it.
MIN_TOP1_AGREEMENT = 0.97
# Near-ties are chance events: at a rate of 1.5% a scenario of 192 positions sees 2.9 on
# average but 6 about once in 14 runs, which is 96.9%. So the floor is also never below the
# count of near-ties that such a rate exceeds once in a thousand runs (Poisson); every
# mismatch must still be a near-tie, which is where a real fault shows.
NEAR_TIE_RATE = 0.015


def allowed_mismatches(positions: int) -> int:
    """Mismatches a scenario of `positions` greedy positions may show."""
    mean = NEAR_TIE_RATE * positions
    count, term, below = 0, math.exp(-mean), 0.0
    while below + term < 0.999:  # the 99.9th percentile of Poisson(mean)
        below += term
        count += 1
        term *= mean / count
    return max(int((1 - MIN_TOP1_AGREEMENT) * positions), count)


def native_bf16_kernels_available() -> bool:
    """Whether this machine runs the default CPU path (x86-64 with AVX2, and a C compiler)."""
    from pagellm.kernels.linear_bindings import cpu_linear_kernels

    return cpu_linear_kernels() is not None


def _roundings(num_layers: int) -> int:
    return ROUNDINGS_PER_LAYER * num_layers + ROUNDINGS_OUTSIDE_LAYERS


def logit_error_bound(num_layers: int, logit_scale: float) -> float:
    """Largest |bf16 logit - float32 logit| to accept (logits compared up to a constant).

    Each rounding moves the value it rounds by at most BF16_ROUNDING relative; RMSNorm
    renormalizes the residual stream before every use, so a relative error made anywhere
    reaches the logits as about the same relative error of the logit vector, whose scale is
    `logit_scale` (the float32 logits' standard deviation). Added worst-case (linearly)
    over every rounding of every layer and of the head:
        bound = (ROUNDINGS_PER_LAYER * layers + ROUNDINGS_OUTSIDE_LAYERS) * 2^-9 * scale
    (3 layers: 48 roundings, 9.4% of the logits' spread; measured on the test model: 1.7%).
    """
    return _roundings(num_layers) * BF16_ROUNDING * logit_scale


def logit_rms_bound(num_layers: int, logit_scale: float) -> float:
    """Largest root-mean-square bf16 logit error to accept over many logits.

    A round-to-nearest error is uniform in +-2^-9 (relative), standard deviation
    2^-9 / sqrt(3); independent roundings add in quadrature, so N of them leave a relative
    error of sqrt(N) * 2^-9 / sqrt(3) (3 layers: 0.78% of the logits' spread; measured on
    the test model: 0.5%). Twice that is accepted, for the amplification by attention's
    softmax; a stage that is wrong by more than a few roundings' worth is not.
    """
    return 2 * math.sqrt(_roundings(num_layers)) * BF16_ROUNDING / math.sqrt(3) * logit_scale


def near_tie_bound(num_layers: int, logit_scale: float) -> float:
    """Largest float32 logit gap at which bf16 may pick the other token.

    If every bf16 logit is within e of float32's, bf16 can prefer token t over float32's
    top-1 a only when z_a - z_t <= e_t - e_a <= 2e.
    """
    return 2 * logit_error_bound(num_layers, logit_scale)


def logprob_error_bound(num_layers: int, logit_scale: float) -> float:
    """Largest |bf16 - float32| log-probability of one token: log p_t = z_t - logsumexp(z),
    and logsumexp moves by at most the largest logit error, so twice the logit bound."""
    return 2 * logit_error_bound(num_layers, logit_scale)


def logprob_rms_bound(num_layers: int, logit_scale: float) -> float:
    """Root-mean-square bound for log-probabilities: the token's logit error and the
    logsumexp's (a probability-weighted mean of logit errors) add in quadrature at most."""
    return math.sqrt(2) * logit_rms_bound(num_layers, logit_scale)


# ------------------------------------------------------------------------ the model


# Tiny Llama for the default path: head_dim 64 (two query heads, one KV head) so the bf16
# attention specialisation (csrc/paged_decode_bf16.c) runs; three layers.
DEFAULT_PATH_SHAPE = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=3,
    num_attention_heads=2,
    num_key_value_heads=1,
)
# make_tiny_hf_checkpoint draws matrices with std 0.15: at hidden 128 every projection then
# multiplies activations by ~1.7, and the three layers amplify a rounding so much that even
# HF's own bf16 run agrees with its float32 run at only ~95% of positions. Scaled to std
# 0.06 the model is conditioned like a trained one (HF bf16 vs float32: ~99%) and its
# greedy outputs stay varied (~15 distinct tokens in 24).
WEIGHT_SCALE = 0.4


def make_default_path_checkpoint(folder: Path, seed: int = 3, arch: str = "llama", **overrides: object) -> Path:
    """A tiny random HF folder (hf_models.make_tiny_hf_checkpoint, Llama unless `arch`
    says) with its matrices scaled by WEIGHT_SCALE (norms and embedding as they are)."""
    make_tiny_hf_checkpoint(folder, arch, seed=seed, **{**DEFAULT_PATH_SHAPE, **overrides})
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    for name, tensor in tensors.items():
        if tensor.dim() == 2 and "embed" not in name:
            tensors[name] = (tensor * WEIGHT_SCALE).contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})
    return folder


# ------------------------------------------------------------------------ scenarios


@dataclass
class Scenario:
    """A batch of requests through one engine configuration, and the regime it must show."""

    name: str
    prompts: list[list[int]]
    params: list[SamplingParams]
    engine_args: dict = field(default_factory=dict)
    expect: dict[str, int] = field(default_factory=dict)  # scheduling fact -> minimum value


@dataclass
class Completion:
    prompt: list[int]
    token_ids: list[int]
    logprobs: list[dict] | None  # per generated position: token id -> Logprob
    greedy: bool


@dataclass
class PathCalls:
    """Forward passes per native route: rows of each call, and whether all were decodes."""

    fused_decode: list[int] = field(default_factory=list)  # decode steps of <= MAX_ROWS
    native_layers_decode: list[int] = field(default_factory=list)  # decode steps above
    native_layers_prefill: list[int] = field(default_factory=list)  # steps with prefill


@dataclass
class ScenarioRun:
    scenario: Scenario
    dtype: str
    completions: list[Completion]
    facts: dict[str, int]
    paths: PathCalls | None  # None: the model has no native routes (float32)


# What the scheduler did, from LLMEngine.get_stats() (core/scheduler_stats.py): none of
# it may depend on the precision of the numbers computed.
SCHEDULING_FACTS = (
    "num_preemptions_recompute",
    "num_preemptions_swap",
    "num_swapped_out_blocks",
    "num_swapped_in_blocks",
    "num_prefix_query_tokens",
    "num_prefix_hit_tokens",
    "num_prefill_tokens",
    "num_decode_tokens",
)


def scheduling_facts(llm: LLM) -> dict[str, int]:
    stats = llm.engine.get_stats()
    return {name: getattr(stats, name) for name in SCHEDULING_FACTS}


@contextlib.contextmanager
def count_native_paths(llm: LLM) -> Iterator[PathCalls | None]:
    """Record every call into the one-call decode layer and the native layer ops."""
    paths = llm.engine.runner.step_paths
    fused = getattr(paths.get("fused"), "fused", None)
    native = getattr(paths.get("layers"), "layer_ops", None)
    if fused is None and native is None:
        yield None
        return
    calls = PathCalls()

    def wrap(target, record):  # noqa: ANN001, ANN202
        run = target.run

        def counted(hidden, positions, kv_caches, metadata):  # noqa: ANN001, ANN202
            record(hidden.shape[0], metadata.num_reqs == hidden.shape[0])
            return run(hidden, positions, kv_caches, metadata)

        target.run = counted

    def record_fused(rows: int, decodes_only: bool) -> None:
        calls.fused_decode.append(rows)

    def record_native(rows: int, decodes_only: bool) -> None:
        (calls.native_layers_decode if decodes_only else calls.native_layers_prefill).append(rows)

    wrapped = [t for t in (fused, native) if t is not None]
    if fused is not None:
        wrap(fused, record_fused)
    if native is not None:
        wrap(native, record_native)
    try:
        yield calls
    finally:
        for target in wrapped:
            del target.run  # the class's method again


def run_scenario(
    model: str, scenario: Scenario, dtype: str, inspect: Callable[[LLM], None] | None = None, **engine_args: object
) -> ScenarioRun:
    """Run the scenario's requests on a fresh engine; the engine must end drained.
    `inspect` sees the engine once it is built (what a test checks of its load)."""
    args = {"dtype": dtype, "disable_log_stats": True, **scenario.engine_args, **engine_args}
    llm = LLM(model, **args)
    if inspect is not None:
        inspect(llm)
    completions: list[Completion] = []
    with count_native_paths(llm) as paths:
        outputs = llm.generate(scenario.prompts, scenario.params, use_tqdm=False)
        for prompt, params, output in zip(scenario.prompts, scenario.params, outputs, strict=True):
            assert len(output.outputs) == params.n
            completions += [
                Completion(list(prompt), list(c.token_ids), c.logprobs, params.temperature == 0.0)
                for c in output.outputs
            ]
        assert_engine_drained(llm)
    facts = scheduling_facts(llm)
    llm.engine.close()
    return ScenarioRun(scenario, dtype, completions, facts, paths)


def standard_scenarios(vocab_size: int, seed: int = 7) -> list[Scenario]:
    """The engine's regimes, each on a small batch: plain batching, chunked prefill,
    recompute and swap preemption, prefix caching, n > 1.

    Generation lengths are fixed (ignore_eos) so the float32 and bf16 runs do the same
    work; every request asks for its emitted tokens' log-probabilities (logprobs=0).
    """
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab_size) for _ in range(n)]

    def greedy(max_tokens: int, n: int = 1) -> SamplingParams:
        return SamplingParams(temperature=0.0, n=n, max_tokens=max_tokens, ignore_eos=True, logprobs=0)

    # 24 requests whose lengths differ, so the decode batch shrinks from 24 (native layer
    # ops: more than MAX_ROWS decodes) to a few (the one-call decode layer).
    plain_lengths = [1, 2, 3, 5, 8, 11, 13, 15, 16, 17, 20, 24, 29, 31, 32, 33, 37, 40, 45, 47, 52, 58, 64, 70]
    plain = Scenario(
        "plain",
        [tokens(n) for n in plain_lengths],
        [greedy(8 + (i * 7) % 25) for i in range(len(plain_lengths))],
        {"max_model_len": 128},
    )
    chunk_lengths = [3, 17, 29, 40, 55, 70, 9, 33]
    chunked = Scenario(
        "chunked_prefill",
        [tokens(n) for n in chunk_lengths],
        [greedy(32) for _ in chunk_lengths],
        {"max_model_len": 128, "max_num_batched_tokens": 16},
    )
    # 12 usable blocks of 16 tokens, the longest request needs 6: requests are preempted.
    tight_lengths = [70, 47, 33, 21, 64, 15, 40, 5, 58, 27, 9, 50]
    tight_prompts = [tokens(n) for n in tight_lengths]
    tight = {"max_model_len": 96, "num_gpu_blocks_override": 13, "enable_prefix_caching": False}
    recompute = Scenario(
        "recompute_preemption",
        tight_prompts,
        [greedy(24) for _ in tight_prompts],
        {**tight, "preemption_mode": "recompute"},
        expect={"num_preemptions_recompute": 1},
    )
    swap = Scenario(
        "swap_preemption",
        tight_prompts,
        [greedy(24) for _ in tight_prompts],
        {**tight, "preemption_mode": "swap", "swap_space": 0.01},
        expect={"num_preemptions_swap": 1, "num_swapped_out_blocks": 1, "num_swapped_in_blocks": 1},
    )
    # Ten prompts behind one 50-token prefix (3 full blocks), two at a time: the eight that
    # start after the first two find the prefix cached; two repeat an earlier prompt whole
    # (one of them 64 tokens, block-aligned: its last token must still be computed).
    shared = tokens(50)
    first = [shared + tokens(k) for k in (1, 5, 14, 20, 9, 30, 3, 25)]
    prefix_prompts = [*first, list(first[2]), list(first[3])]
    prefix = Scenario(
        "prefix_caching",
        prefix_prompts,
        [greedy(40) for _ in prefix_prompts],
        {"max_model_len": 128, "max_num_seqs": 2},
        expect={"num_prefix_hit_tokens": 8 * 48},
    )
    # n > 1: greedy completions fork from the prompt's blocks (copy-on-write of a partial
    # last block) and must each be greedy; seeded sampled ones are checked on the
    # log-probabilities of what they drew. 8 requests x 3 completions: decode steps of 24.
    parallel_lengths = [7, 19, 26, 40, 3, 35, 12, 50]
    parallel_params = [
        greedy(32, n=3)
        if i < 6
        else SamplingParams(temperature=1.0, seed=11 + i, n=3, max_tokens=32, ignore_eos=True, logprobs=0)
        for i in range(len(parallel_lengths))
    ]
    parallel = Scenario(
        "parallel_sampling",
        [tokens(n) for n in parallel_lengths],
        parallel_params,
        {"max_model_len": 128},
    )
    return [plain, chunked, recompute, swap, prefix, parallel]


# ------------------------------------------------------------------------ comparison


@dataclass
class Mismatch:
    completion: int
    position: int  # index among the generated tokens
    emitted: int
    reference_top1: int
    gap: float  # reference logit of its top-1 minus that of the emitted token


@dataclass
class TeacherForced:
    """HF float32 over each completion's prompt + generated tokens."""

    positions: int = 0  # greedy positions compared for top-1
    agreed: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)
    logprob_errors: list[float] = field(default_factory=list)  # |pagellm - HF|, every position
    logit_scale: float = 0.0  # mean standard deviation of HF's logits at the positions

    @property
    def agreement(self) -> float:
        return self.agreed / self.positions if self.positions else 1.0

    @property
    def max_gap(self) -> float:
        return max((m.gap for m in self.mismatches), default=0.0)

    @property
    def max_logprob_error(self) -> float:
        return max(self.logprob_errors, default=0.0)

    @property
    def rms_logprob_error(self) -> float:
        errors = self.logprob_errors
        return math.sqrt(sum(e * e for e in errors) / len(errors)) if errors else 0.0


@torch.inference_mode()
def reference_logits(hf_model: torch.nn.Module, token_ids: Sequence[int]) -> torch.Tensor:
    """HF's float32 logits at every position of one sequence: [len, vocab]."""
    return hf_model(input_ids=torch.tensor([list(token_ids)])).logits[0].float()


def teacher_forced(hf_model: torch.nn.Module, completions: Sequence[Completion]) -> TeacherForced:
    """At each generated position: HF's argmax vs the emitted token (greedy completions),
    and HF's log-probability of the emitted token vs pagellm's (when it returned them).
    Identical sequences are compared once."""
    result = TeacherForced()
    scales: list[float] = []
    seen: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    for index, completion in enumerate(completions):
        prompt, generated = completion.prompt, completion.token_ids
        # A sequence that came out more than once (n > 1 greedy, a repeated prompt) is
        # one set of positions: counting its near-ties again would only weigh them twice.
        key = (tuple(prompt), tuple(generated))
        if not generated or key in seen:
            continue
        seen.add(key)
        logits = reference_logits(hf_model, prompt + generated)[len(prompt) - 1 : -1]  # predict generated
        scales.append(float(logits.std(dim=-1).mean()))
        emitted = torch.tensor(generated)
        if completion.greedy:
            top1 = logits.argmax(dim=-1)
            gaps = logits.gather(1, top1[:, None])[:, 0] - logits.gather(1, emitted[:, None])[:, 0]
            result.positions += len(generated)
            for position in range(len(generated)):
                if int(top1[position]) == generated[position]:
                    result.agreed += 1
                else:
                    result.mismatches.append(
                        Mismatch(index, position, generated[position], int(top1[position]), float(gaps[position]))
                    )
        if completion.logprobs is not None:
            reference = logits.log_softmax(dim=-1).gather(1, emitted[:, None])[:, 0]
            for position, token in enumerate(generated):
                pagellm_logprob = completion.logprobs[position][token].logprob
                result.logprob_errors.append(abs(pagellm_logprob - float(reference[position])))
    result.logit_scale = sum(scales) / len(scales) if scales else 0.0
    return result


@dataclass
class PrefillLogits:
    """Full-vocabulary log-probabilities at each prompt's last position."""

    errors: list[float]  # per prompt: max |pagellm - HF| over the vocabulary, up to a constant
    relative_errors: list[float]  # per prompt: ||difference|| / ||HF's logits - their mean||
    logit_scales: list[float]  # per prompt: standard deviation of HF's logits


def prefill_logits(
    model: str, hf_model: torch.nn.Module, prompts: Sequence[Sequence[int]], dtype: str, vocab_size: int,
    **engine_args: object,
) -> PrefillLogits:
    """pagellm's distribution of the first generated token (the logits of the prefill's
    last position, through the engine's logprobs) against HF float32's.

    The log-probabilities differ from the logits by one constant per row (the log of the
    softmax denominator), so both are centred before comparing: what is compared is the
    logits up to that constant, exactly what softmax and argmax see.
    """
    args = {"dtype": dtype, "disable_log_stats": True, "max_logprobs": vocab_size, **engine_args}
    llm = LLM(model, **args)
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=vocab_size, ignore_eos=True)
    outputs = llm.generate([list(p) for p in prompts], params, use_tqdm=False)
    assert_engine_drained(llm)
    llm.engine.close()
    result = PrefillLogits([], [], [])
    for prompt, output in zip(prompts, outputs, strict=True):
        entries = output.outputs[0].logprobs[0]
        assert len(entries) == vocab_size
        ours = torch.tensor([entries[token].logprob for token in range(vocab_size)], dtype=torch.float64)
        theirs = reference_logits(hf_model, prompt)[-1].double()
        difference = (ours - ours.mean()) - (theirs - theirs.mean())
        result.errors.append(float(difference.abs().max()))
        result.relative_errors.append(float(difference.norm() / (theirs - theirs.mean()).norm()))
        result.logit_scales.append(float(theirs.std()))
    return result


# ------------------------------------------------------------------------ checks


def check_against_reference(
    result: TeacherForced, num_layers: int, label: str = "", reference_bf16_worst: float | None = None
) -> None:
    """Top-1 agreement, near-ties only where it differs, log-probabilities within bounds.

    `reference_bf16_worst`: for a model with discrete choices inside (a mixture of experts'
    routing, which a bf16 rounding can flip), the worst log-probability error HF's own bf16
    run shows on the same sequences; the worst-case bound is then at least twice that."""
    scale = result.logit_scale
    assert result.positions > 0 or result.logprob_errors, f"{label}: nothing compared"
    allowed = allowed_mismatches(result.positions)
    assert result.positions - result.agreed <= allowed, (
        f"{label}: HF float32's argmax is the emitted token at {result.agreed} of "
        f"{result.positions} positions ({result.agreement:.2%}; at most {allowed} may differ)"
    )
    tie = near_tie_bound(num_layers, scale)
    wide = [m for m in result.mismatches if m.gap > tie]
    assert not wide, f"{label}: bf16 chose against HF float32 where it is no near-tie (> {tie:.4f}): {wide}"
    assert result.logprob_errors, f"{label}: no log-probabilities came back"
    worst, rms = result.max_logprob_error, result.rms_logprob_error
    bound = logprob_error_bound(num_layers, scale)
    if reference_bf16_worst is not None:
        bound = max(bound, 2 * reference_bf16_worst)
    assert worst <= bound, f"{label}: emitted token's log-probability off by {worst:.4f} > {bound:.4f}"
    assert rms <= logprob_rms_bound(num_layers, scale), (
        f"{label}: emitted tokens' log-probabilities off by {rms:.4f} (rms) "
        f"> {logprob_rms_bound(num_layers, scale):.4f}"
    )


def check_prefill_logits(result: PrefillLogits, num_layers: int) -> None:
    """Every prompt's last-position logits within the worst-case bound, each entry, and
    within the root-mean-square bound over the vocabulary."""
    assert result.errors
    for i, (error, relative, scale) in enumerate(
        zip(result.errors, result.relative_errors, result.logit_scales, strict=True)
    ):
        bound = logit_error_bound(num_layers, scale)
        assert error <= bound, f"prompt {i}: a logit off by {error:.4f} > {bound:.4f}"
        rms_bound = logit_rms_bound(num_layers, 1.0)
        assert relative <= rms_bound, f"prompt {i}: logits off by {relative:.2%} (rms) > {rms_bound:.2%}"


def check_native_paths(run: ScenarioRun) -> None:
    """The default path ran: the native routes are attached, prefill went through the
    native layer ops, and no step carried more tokens than the scenario's budget (a prompt
    longer than the budget was chunked)."""
    paths = run.paths
    assert paths is not None, f"{run.scenario.name}: the {run.dtype} model has no native bf16 routes"
    assert paths.native_layers_prefill, f"{run.scenario.name}: no prefill step took the native layer ops"
    budget = run.scenario.engine_args.get("max_num_batched_tokens")
    if budget is not None:
        steps = paths.fused_decode + paths.native_layers_decode + paths.native_layers_prefill
        assert max(steps) <= budget, f"{run.scenario.name}: a step of {max(steps)} tokens > budget {budget}"


def check_same_schedule(run: ScenarioRun, float32_run: ScenarioRun) -> None:
    """The scenario's regime happened, and exactly as it does in float32."""
    for name, minimum in run.scenario.expect.items():
        assert run.facts[name] >= minimum, f"{run.scenario.name}: {name} = {run.facts[name]} < {minimum}"
    assert run.facts == float32_run.facts, (
        f"{run.scenario.name}: {run.dtype} scheduled differently from {float32_run.dtype}: "
        f"{run.facts} != {float32_run.facts}"
    )


@torch.inference_mode()
def hf_bf16_worst_logprob_error(reference: torch.nn.Module, completions) -> float:
    """The largest |log p(HF bf16) - log p(HF float32)| of an emitted token over the same
    sequences: how far bf16 alone moves this model, routing flips included."""
    bf16 = copy.deepcopy(reference).to(torch.bfloat16)
    worst = 0.0
    for completion in completions:
        ids = completion.prompt + completion.token_ids
        sequence = torch.tensor([ids[:-1]])
        f32 = torch.log_softmax(reference(sequence).logits[0].double(), -1)
        b16 = torch.log_softmax(bf16(sequence).logits[0].double(), -1)
        for i, token in enumerate(completion.token_ids):
            position = len(completion.prompt) - 1 + i
            worst = max(worst, abs(float(f32[position, token] - b16[position, token])))
    return worst
