"""Benchmark: speculative decoding on the embedded model, every configuration in one run.

    python benchmarks/spec_decode.py [--quick] [--max-tokens 256] [--dtype auto]

Three figures, each with the acceptance rate it ran at:

1. Single stream, input-grounded (prompts that ask to repeat, correct, rename or
   reformat a passage of a few hundred tokens): output tok/s of greedy decoding alone,
   with n-gram speculation, and with a draft model; one request at a time.
2. The ceiling of the verification step: proposals that are the target's own tokens
   (an oracle: the plain run's output, every proposal accepted, always k of them),
   output tok/s against k + 1 times the plain rate; and the target as its own draft
   model (acceptance 1.0 as well, plus the draft's k forwards a step).
3. The mixed 64-request workload (`bench throughput --workload mixed`'s list: random
   prompts of 16-256 tokens, 16-256 outputs), with and without speculation configured:
   the per-step policy (disable_by_batch_size) must keep it from costing throughput.

Results go to benchmarks/results/spec_decode.json and .md (with the CPU model and ISA).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from pagellm import LLM, SamplingParams
from pagellm.bench.machine import cpu_info, describe_cpu
from pagellm.bench.results import write_result_files

RESULTS = Path(__file__).resolve().parent / "results"

CODE = '''def load_orders(path):
    """Read the orders file and return a list of order dictionaries."""
    orders = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            order_id, customer, amount, status = line.split(",")
            orders.append({"id": int(order_id), "customer": customer, "amount": float(amount), "status": status})
    return orders


def total_by_customer(orders):
    totals = {}
    for order in orders:
        if order["status"] != "paid":
            continue
        totals[order["customer"]] = totals.get(order["customer"], 0.0) + order["amount"]
    return totals


def largest_customers(orders, count=3):
    totals = total_by_customer(orders)
    ranked = sorted(totals.items(), key=lambda item: item[1], reverse=True)
    return ranked[:count]
'''

PASSAGE = (
    "The river town of Elmsworth grew up around a stone bridge built in the twelfth century. "
    "For most of its history the town lived from the wool trade: farmers brought fleeces from the "
    "hills every spring, merchants weighed and sorted them in the market hall, and barges carried "
    "the bales downstream to the coast. When the railway arrived in 1852 the barges disappeared within "
    "a decade, but the town found a new trade in the mills that were built along the river bank. "
    "The mills closed one by one after the Second World War, and today the largest of them houses a "
    "museum, a library and a small theatre. Visitors come for the bridge, the market hall and the walk "
    "along the old towpath, which follows the river for eleven miles to the village of Harrowby."
)

CONFIG = "name,quantity,price\napples,12,0.40\npears,8,0.55\nplums,30,0.20\ncherries,200,0.05\nlemons,6,0.35\n"

# Tasks whose answers quote their input: what prompt lookup is for.
GROUNDED_PROMPTS = [
    f"Rename the function `load_orders` to `read_orders` everywhere in this code. Reply with the full code only.\n\n{CODE}",
    f"Repeat the following passage exactly, word for word.\n\n{PASSAGE}",
    f"Rename the variable `totals` to `sums` in this code and return the whole code.\n\n{CODE}",
    f"Copy this CSV table and add a fourth column `total` equal to quantity times price.\n\n{CONFIG}",
]


def single_stream(
    model: str | None, dtype: str, prompts: list[str], max_tokens: int, spec: dict[str, Any] | None
) -> dict[str, Any]:
    """Each prompt alone (a lone user), greedy; tok/s over all of them after a warm-up."""
    llm = LLM(model, dtype=dtype, max_model_len=2048, speculative_config=spec, disable_log_stats=True)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    llm.chat([[{"role": "user", "content": "Say hello."}]], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    before = llm.get_metrics()
    tokens: list[list[int]] = []
    prompt_token_ids: list[list[int]] = []
    elapsed = 0.0
    for prompt in prompts:
        start = time.perf_counter()
        out = llm.chat([[{"role": "user", "content": prompt}]], params, use_tqdm=False)[0]
        elapsed += time.perf_counter() - start
        tokens.append(list(out.outputs[0].token_ids))
        prompt_token_ids.append(list(out.prompt_token_ids))
    after = llm.get_metrics()
    llm.shutdown()
    output_tokens = sum(len(t) for t in tokens)
    return {
        "speculative_config": spec,
        "output_tokens": output_tokens,
        "seconds": round(elapsed, 3),
        "output_tok_s": round(output_tokens / elapsed, 1),
        **speculation_figures(before, after),
        "token_ids": tokens,
        "prompt_token_ids": prompt_token_ids,
    }


def speculation_figures(before: Any, after: Any) -> dict[str, Any]:
    """Acceptance over the timed part, from the offline metrics' speculation totals."""
    b, a = getattr(before, "spec_decode", None), getattr(after, "spec_decode", None)
    if a is None:
        return {}
    verifications = a.num_verifications - b.num_verifications
    proposed = a.num_proposed_tokens - b.num_proposed_tokens
    accepted = a.num_accepted_tokens - b.num_accepted_tokens
    return {
        "verifications": verifications,
        "proposed": proposed,
        "accepted": accepted,
        "acceptance_rate": round(accepted / proposed, 3) if proposed else None,
        "mean_accepted_length": round((accepted + verifications) / verifications, 2) if verifications else None,
    }


def oracle_ceiling(
    model: str | None, dtype: str, prompts: list[str], max_tokens: int, baseline: dict[str, Any], k: int
) -> dict[str, Any]:
    """Propose exactly what the plain run produced next (k tokens, always)."""
    import pagellm.spec_decode.speculator as speculator_module

    runs = [(tuple(p), t) for p, t in zip(baseline["prompt_token_ids"], baseline["token_ids"], strict=True)]

    def oracle(token_ids: list[int], k: int, lookup_min: int, lookup_max: int) -> list[int]:
        for prompt, output in runs:
            produced = token_ids[len(prompt) :]
            if tuple(token_ids[: len(prompt)]) == prompt and output[: len(produced)] == produced:
                return output[len(produced) : len(produced) + k]
        return []

    saved = speculator_module.propose_ngram, speculator_module.best_num_tokens
    speculator_module.propose_ngram = oracle
    speculator_module.best_num_tokens = lambda acceptance, ratio, most: most
    try:
        row = single_stream(model, dtype, prompts, max_tokens, {"method": "ngram", "num_speculative_tokens": k})
    finally:
        speculator_module.propose_ngram, speculator_module.best_num_tokens = saved
    row["proposals"] = "oracle (the plain run's tokens)"
    row["ceiling_tok_s"] = round((k + 1) * baseline["output_tok_s"], 1)
    row["of_ceiling"] = round(row["output_tok_s"] / row["ceiling_tok_s"], 3)
    row["speedup"] = round(row["output_tok_s"] / baseline["output_tok_s"], 3)
    return row


def target_as_draft(
    model: str | None, dtype: str, prompts: list[str], max_tokens: int, baseline: dict[str, Any], k: int
) -> dict[str, Any]:
    """The target model as its own draft, proposing k tokens every step."""
    import pagellm.spec_decode.speculator as speculator_module
    from pagellm.model.loader import resolve_model_source

    saved = speculator_module.best_num_tokens
    speculator_module.best_num_tokens = lambda acceptance, ratio, most: most  # the policy would decline
    try:
        path = str(resolve_model_source(model).path)
        row = single_stream(model, dtype, prompts, max_tokens, {"model": path, "num_speculative_tokens": k})
    finally:
        speculator_module.best_num_tokens = saved
    row["proposals"] = "the target as its own draft"
    row["ceiling_tok_s"] = round((k + 1) * baseline["output_tok_s"], 1)
    row["of_ceiling"] = round(row["output_tok_s"] / row["ceiling_tok_s"], 3)
    row["speedup"] = round(row["output_tok_s"] / baseline["output_tok_s"], 3)
    return row


def mixed_throughput(model: str | None, dtype: str, num_requests: int, spec: dict[str, Any] | None) -> dict[str, Any]:
    from pagellm.workload.synthetic import WorkloadSpec, make_workload

    workload = make_workload(
        WorkloadSpec(kind="mixed", num_requests=num_requests, prompt_len=(16, 256), output_len=(16, 256), seed=0),
        max_model_len=2048,
    )
    llm = LLM(model, dtype=dtype, max_model_len=2048, speculative_config=spec, disable_log_stats=True)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4), use_tqdm=False)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload]
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in workload]
    before = llm.get_metrics()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    after = llm.get_metrics()
    llm.shutdown()
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "speculative_config": spec,
        "num_requests": num_requests,
        "output_tokens": output_tokens,
        "seconds": round(elapsed, 2),
        "output_tok_s": round(output_tokens / elapsed, 1),
        **speculation_figures(before, after),
    }


def same_tokens(a: list[list[int]], b: list[list[int]]) -> str:
    """How many outputs are identical, and where the first difference is otherwise."""
    equal = sum(x == y for x, y in zip(a, b, strict=True))
    return f"{equal}/{len(a)} identical"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF file or HF folder (default: the embedded SmolLM2)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-tokens", type=int, default=320)
    parser.add_argument("--k", type=int, nargs="+", default=[2, 4, 6])
    parser.add_argument("--mixed-requests", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="two prompts, k=4, 16 mixed requests")
    parser.add_argument("--skip-mixed", action="store_true")
    parser.add_argument("--ceiling-k", type=int, nargs="+", default=[2, 4, 6])
    args = parser.parse_args()
    prompts = GROUNDED_PROMPTS[:2] if args.quick else GROUNDED_PROMPTS
    ks = [4] if args.quick else args.k
    mixed_requests = 16 if args.quick else args.mixed_requests

    results: dict[str, Any] = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "cpu": cpu_info(), "dtype": args.dtype,
                               "max_tokens": args.max_tokens, "single_stream": [], "ceiling": [], "mixed": []}  # fmt: skip
    baseline = single_stream(args.model, args.dtype, prompts, args.max_tokens, None)
    results["single_stream"].append(baseline)
    for k in ks:
        spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
        row = single_stream(args.model, args.dtype, prompts, args.max_tokens, spec)
        row["speedup"] = round(row["output_tok_s"] / baseline["output_tok_s"], 3)
        row["tokens_vs_plain"] = same_tokens(row["token_ids"], baseline["token_ids"])
        results["single_stream"].append(row)
        print(json.dumps({key: value for key, value in row.items() if key not in ("token_ids", "prompt_token_ids")}), flush=True)
    for k in [4] if args.quick else args.ceiling_k:
        for run in (oracle_ceiling, target_as_draft):
            row = run(args.model, args.dtype, prompts, args.max_tokens, baseline, k)
            row["tokens_vs_plain"] = same_tokens(row["token_ids"], baseline["token_ids"])
            results["ceiling"].append(row)
            print(json.dumps({key: value for key, value in row.items() if key not in ("token_ids", "prompt_token_ids")}), flush=True)
    if not args.skip_mixed:
        plain = mixed_throughput(args.model, args.dtype, mixed_requests, None)
        spec = {"method": "ngram", "num_speculative_tokens": 4}
        speculating = mixed_throughput(args.model, args.dtype, mixed_requests, spec)
        speculating["ratio"] = round(speculating["output_tok_s"] / plain["output_tok_s"], 3)
        results["mixed"] = [plain, speculating]

    for row in results["single_stream"] + results["ceiling"]:
        row.pop("token_ids", None)
        row.pop("prompt_token_ids", None)
    lines = [f"# Speculative decoding ({results['time']})", "", f"CPU: {describe_cpu(results['cpu'])}; dtype {args.dtype}", "",
             "## Single stream, input-grounded prompts (greedy)", "",
             "| speculation | output tok/s | speedup | acceptance | mean accepted length | tokens vs plain |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for row in results["single_stream"]:
        spec = row["speculative_config"]
        label = "none" if spec is None else json.dumps(spec)
        lines.append(f"| {label} | {row['output_tok_s']} | {row.get('speedup', 1.0)} | {row.get('acceptance_rate')} | "
                     f"{row.get('mean_accepted_length')} | {row.get('tokens_vs_plain', '-')} |")  # fmt: skip
    lines += ["", "## Ceiling of the verification step (every proposal accepted)", "",
              "| proposals | k | output tok/s | (k + 1) x plain | of that | speedup | acceptance | tokens vs plain |",
              "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in results["ceiling"]:
        k = row["speculative_config"]["num_speculative_tokens"]
        lines.append(f"| {row['proposals']} | {k} | {row['output_tok_s']} | {row['ceiling_tok_s']} | {row['of_ceiling']} | "
                     f"{row['speedup']} | {row.get('acceptance_rate')} | {row['tokens_vs_plain']} |")  # fmt: skip
    if results["mixed"]:
        lines += ["", f"## Mixed workload, {mixed_requests} requests", "", "| speculation | output tok/s | ratio | acceptance |", "|---|---|---|---|"]
        for row in results["mixed"]:
            spec = row["speculative_config"]
            label = "none" if spec is None else json.dumps(spec)
            lines.append(f"| {label} | {row['output_tok_s']} | {row.get('ratio', 1.0)} | {row.get('acceptance_rate')} |")
    write_result_files(RESULTS / "spec_decode.json", results, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
