"""Multi-LoRA throughput: requests spread over several adapters against the same requests on
the base model alone, on the embedded SmolLM2 (bf16 on the CPU kernels).

    python benchmarks/lora_overhead.py [--requests 32] [--adapters 8] [--rank 16]

Writes `--adapters` random PEFT adapters (peft itself, every attention and MLP projection,
rank `--rank`, non-zero B) for the model, then runs, in turn and `--repeats` times, the same
requests (random prompt ids, greedy, fixed lengths) on:
  - base: an engine without --enable-lora (the default decode paths),
  - base, LoRA on: the engine with --enable-lora, no request naming an adapter,
  - adapters: the engine with --enable-lora, request i under adapter i % adapters.
Reports output tokens/s (median), the ratio to the base engine, and the time the adapters'
products take per step (timers around every layer's LoRA addition). Prints the CPU and one
JSON line; writes benchmarks/results/lora_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pagellm import LLM, LoRARequest, SamplingParams
from pagellm.bench.machine import cpu_info, describe_cpu
from pagellm.lora.slots import LoRASlots
from pagellm.model.checkpoint.default_model import default_model_path

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapters(model_path: Path, folder: Path, count: int, rank: int) -> list[Path]:
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(model_path.parent, gguf_file=model_path.name, dtype=torch.float32)
    paths = []
    for i in range(count):
        torch.manual_seed(i)
        model = peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                                          init_lora_weights=False))  # fmt: skip
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "lora_" in name:
                    parameter.copy_(torch.randn_like(parameter) * 0.01)
        model.save_pretrained(folder / f"adapter{i}")
        paths.append(folder / f"adapter{i}")
        base = model.unload()  # the plain model back, for the next adapter
    return paths


class LoRATimer:
    """Seconds spent in LoRASlots.add_to (every layer's adapter products)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._original = LoRASlots.add_to
        timer = self

        def timed(slots: LoRASlots, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
            start = time.perf_counter()
            result = timer._original(slots, x, out)
            timer.seconds += time.perf_counter() - start
            return result

        LoRASlots.add_to = timed  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", default="benchmarks/results/lora_overhead.json")
    args = parser.parse_args()
    model_path = default_model_path()
    print(f"CPU: {describe_cpu(cpu_info())}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (args.prompt_len,), generator=generator).tolist() for _ in range(args.requests)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    timer = LoRATimer()
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_adapters(model_path, Path(tmp), args.adapters, args.rank)
        loras = [LoRARequest(f"adapter{i}", i + 1, str(p)) for i, p in enumerate(paths)]
        common = dict(dtype="bfloat16", max_num_seqs=args.requests, disable_log_stats=True)
        engines = {
            "base": LLM(str(model_path), **common),
            "base, LoRA on": LLM(str(model_path), enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank, **common),
        }
        engines["adapters"] = engines["base, LoRA on"]
        per_request = {"base": None, "base, LoRA on": None, "adapters": [loras[i % len(loras)] for i in range(args.requests)]}
        for name, llm in engines.items():  # warm-up: kernel choice, adapters read and loaded
            llm.generate(prompts[:4], params, lora_request=(per_request[name] or [None] * 4)[:4], use_tqdm=False)
        runs: dict[str, list[float]] = {name: [] for name in engines}
        lora_seconds: list[float] = []
        steps: list[int] = []
        for _ in range(args.repeats):
            for name, llm in engines.items():
                llm.engine.scheduler.kv_cache_manager.reset_prefix_cache()
                before, steps_before = timer.seconds, llm.engine.num_steps
                start = time.perf_counter()
                llm.generate(prompts, params, lora_request=per_request[name], use_tqdm=False)
                runs[name].append(args.requests * args.output_len / (time.perf_counter() - start))
                if name == "adapters":
                    lora_seconds.append(timer.seconds - before)
                    steps.append(llm.engine.num_steps - steps_before)
    medians = {name: statistics.median(v) for name, v in runs.items()}
    per_step_ms = statistics.median(s / n * 1e3 for s, n in zip(lora_seconds, steps))
    for name, value in medians.items():
        print(f"{name:14s} {value:7.1f} output tok/s  ({value / medians['base']:.2f}x base)  runs {[round(v, 1) for v in runs[name]]}")
    print(f"adapters' products: {per_step_ms:.2f} ms per step (median over runs; {statistics.median(steps)} steps a run)")
    record = {"benchmark": "lora_overhead", "cpu": cpu_info(), "threads": torch.get_num_threads(), **vars(args),
              "tok_s": runs, "median_tok_s": medians, "ratio_to_base": {k: v / medians["base"] for k, v in medians.items()},
              "lora_ms_per_step": per_step_ms, "steps_per_run": steps}  # fmt: skip
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(record, indent=1))
    print(json.dumps(record))


if __name__ == "__main__":
    main()
