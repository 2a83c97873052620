"""Sim stage: `pagellm calibrate`'s measurement: a short sweep on the real engine.

The sweep runs small scripted workloads that cover the batches an engine meets: decode
batches of 1 to max_num_seqs requests at short and long contexts, single and grouped
prompts of increasing length, and mixed traffic where new prompts are chunked in among
running decodes. Every step is timed (EngineProbe) with its batch, and the step costs
are fitted (calibrated.py). Imports torch (through the engine) only when it runs.
"""

from __future__ import annotations

import logging
import platform
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagellm.config.cache import DTYPE_BYTES
from pagellm.errors import ConfigError
from pagellm.sampling_params import SamplingParams
from pagellm.sim.calibrated import CalibratedCostModel, fit_step_costs
from pagellm.core.step_batch import StepBatch

from pagellm.sim.engine_probe import EngineProbe

if TYPE_CHECKING:
    from pagellm.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

# Prefill chunks longer than this are left out of the sweep by default: on CPUs the
# attention of one long chunk grows faster than quadratically (its score matrices fall
# out of cache), which a linear fit cannot follow. Steps beyond the measured range are
# counted as extrapolated by the simulator.
DEFAULT_MAX_CHUNK = 1024


@dataclass(frozen=True)
class SweepRequest:
    start_step: int  # added before this step of its case
    prompt_len: int
    output_len: int


@dataclass(frozen=True)
class SweepCase:
    label: str
    requests: tuple[SweepRequest, ...]


@dataclass(frozen=True)
class MeasuredStep:
    case: str
    batch: StepBatch
    seconds: float


def sweep_cases(
    max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, *, quick: bool = False,
    max_chunk: int = DEFAULT_MAX_CHUNK, seed: int = 0,
) -> list[SweepCase]:
    """The scripted workloads, sized to the engine's limits."""
    rng = random.Random(seed)
    longest_prompt = max(1, min(max_chunk, max_num_batched_tokens, max_model_len - 16))
    decode_steps = 4 if quick else 6
    cases: list[SweepCase] = []
    # Every size up to 8 (matmuls of a few rows take other paths than blocked ones),
    # then roughly doubling; long contexts only where their prompts stay affordable.
    sizes = [1, 2, 4, 7, 8, 16] if quick else [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256]
    for context in (16, 300):
        prompt = min(context, longest_prompt)
        for size in sizes:
            if size > max_num_seqs or (prompt > 16 and size > 64):
                break
            cases.append(SweepCase(
                f"decode x{size} ctx{prompt}",
                tuple(SweepRequest(0, prompt, decode_steps) for _ in range(size)),
            ))  # fmt: skip
    lengths = [8, 64, 256] if quick else [8, 32, 96, 256, 512, 768, 1024]
    for length in lengths:
        if length <= longest_prompt:
            cases.append(SweepCase(f"prefill {length}", (SweepRequest(0, length, 2),)))
    groups = [(4, 64)] if quick else [(4, 64), (8, 128), (4, 256), (16, 32)]
    for count, length in groups:
        if count <= max_num_seqs and length <= longest_prompt:
            cases.append(SweepCase(
                f"prefill {count}x{length}",
                tuple(SweepRequest(0, length, 2) for _ in range(count)),
            ))  # fmt: skip
    # New prompts arriving while others decode: chunked prefill mixed with decodes.
    num_mixed = 12 if quick else 64
    for label, every in (("mixed steady", 1), ("mixed bursts", 8)):
        requests = []
        for index in range(num_mixed):
            start = index if every == 1 else (index // 8) * every * 3
            prompt = rng.randint(16, max(16, min(512, longest_prompt)))
            output = rng.randint(4, 24 if quick else 96)
            requests.append(SweepRequest(start, prompt, max(1, min(output, max_model_len - prompt))))
        cases.append(SweepCase(label, tuple(requests)))
    return cases


def run_case(
    probe: EngineProbe, case: SweepCase, rng: random.Random, vocab: tuple[int, int]
) -> list[MeasuredStep]:
    """Run one case to completion on the probe's engine, timing every step."""
    engine = probe.engine
    pending = sorted(case.requests, key=lambda r: r.start_step)
    measured = []
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].start_step <= step:
            request = pending.pop(0)
            prompt = [rng.randrange(*vocab) for _ in range(request.prompt_len)]
            engine.add_request(
                None, prompt,
                SamplingParams(max_tokens=request.output_len, ignore_eos=True, temperature=0.0),
            )  # fmt: skip
        step += 1
        if not engine.has_unfinished_requests():
            continue
        _, batch, seconds = probe.step()
        if batch.num_tokens:
            measured.append(MeasuredStep(case.label, batch, seconds))
    return measured


def token_id_range(vocab_size: int) -> tuple[int, int]:
    """Ordinary token ids to draw prompts from (clear of the specials at the start)."""
    return (min(100, vocab_size // 2), min(30000, vocab_size))


def measure_steps(
    engine: LLMEngine,
    cases: Sequence[SweepCase],
    *,
    seed: int = 0,
    on_case: Callable[[SweepCase, list[MeasuredStep]], None] | None = None,
) -> list[MeasuredStep]:
    """Warm the engine up (first calls allocate and pick kernels), then run every case."""
    probe = EngineProbe(engine)
    rng = random.Random(seed)
    vocab = token_id_range(engine.model_config.vocab_size)
    warm_up = SweepCase("warm-up", tuple(SweepRequest(0, 32, 4) for _ in range(4)))
    run_case(probe, warm_up, rng, vocab)
    measured: list[MeasuredStep] = []
    for case in cases:
        steps = run_case(probe, case, rng, vocab)
        if on_case is not None:
            on_case(case, steps)
        measured.extend(steps)
    return measured


def machine_description() -> str:
    import os

    import torch

    return (
        f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )


def calibrate_engine(
    engine: LLMEngine,
    *,
    quick: bool = False,
    max_chunk: int = DEFAULT_MAX_CHUNK,
    seed: int = 0,
    on_case: Callable[[SweepCase, list[MeasuredStep]], None] | None = None,
    sweeps: int = 1,
    earlier: list[MeasuredStep] | None = None,
    earlier_sweeps: int = 0,
) -> tuple[CalibratedCostModel, list[MeasuredStep]]:
    """Measure the sweep on `engine` (`sweeps` times, fitting all the steps together: on a
    noisy machine one sweep's timings of the same step vary by 10-20%) and fit a
    CalibratedCostModel to it, together with `earlier` steps (`earlier_sweeps` sweeps
    measured before on the same engine, e.g. on the other side of a run to be predicted,
    so that the machine's drift over the run is averaged into the fit)."""
    if sweeps < 1:
        raise ConfigError(f"sweeps must be at least 1, got {sweeps}")
    scheduler_config = engine.config.scheduler_config
    cases = sweep_cases(
        scheduler_config.max_num_seqs, scheduler_config.max_num_batched_tokens,
        scheduler_config.max_model_len, quick=quick, max_chunk=max_chunk, seed=seed,
    )  # fmt: skip
    start = time.perf_counter()
    measured = list(earlier or [])
    for sweep in range(earlier_sweeps, earlier_sweeps + sweeps):
        measured += measure_steps(engine, cases, seed=seed + sweep, on_case=on_case)
    native_max = native_decode_max_reqs(engine)
    fit = fit_step_costs([m.batch for m in measured], [m.seconds for m in measured], native_max)
    dtype = engine.config.dtype
    metadata = {
        "machine": machine_description(),
        "device": engine.config.device_type,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "sweep_seconds": round(time.perf_counter() - start, 1),
        "sweeps": earlier_sweeps + sweeps,
        # The range the fit saw; the simulator counts steps beyond it as extrapolated.
        "max_measured_tokens": max(m.batch.num_tokens for m in measured),
        "max_measured_chunk": max((max(m.batch.prefill_num_tokens, default=0) for m in measured), default=0),
        "max_measured_reqs": max(m.batch.num_reqs for m in measured),
        "native_decode_max_reqs": native_max,
        "engine": {
            "max_num_seqs": scheduler_config.max_num_seqs,
            "max_num_batched_tokens": scheduler_config.max_num_batched_tokens,
            "max_model_len": scheduler_config.max_model_len,
            "block_size": engine.config.cache_config.block_size,
        },
    }
    model = CalibratedCostModel(
        fit, engine.config.source.name, engine.model_config, dtype,
        DTYPE_BYTES[dtype], metadata,
    )  # fmt: skip
    return model, measured


def native_decode_max_reqs(engine: LLMEngine) -> int:
    """Most decodes a decode-only step may have to take the engine's native path (0: none)."""
    if "fused" not in engine.executor_report.step_paths:
        return 0
    from pagellm.kernels.decode_layer import MAX_ROWS

    return MAX_ROWS
