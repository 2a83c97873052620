"""Structured outputs: llguidance against xgrammar as the grammar engine, on the same
tokenizer, constraints and decode states in one run (the measurement behind pagellm's
choice of llguidance, pagellm/structured/).

    python benchmarks/structured_backends.py            # the full run (under a minute)
    python benchmarks/structured_backends.py --quick    # a smoke run (seconds)
    python benchmarks/structured_backends.py --threads 1 --steps 50

Tokenizer: the embedded SmolLM2's (49152 tokens), set up as pagellm does for llguidance
(LLTokenizer from the tokenizers JSON, n_vocab = the model's vocabulary, its EOS ids) and
as xgrammar needs (a transformers PreTrainedTokenizerFast wrapping the same tokenizer,
then TokenizerInfo.from_huggingface with the same vocabulary size and stop ids).

1. Tokenizer setup: median seconds of each (xgrammar's includes the transformers wrapper).
2. Compile: a corpus of JSON schemas (flat, nested, arrays with $ref/$defs and
   min/maxItems, enums, bounded numbers, string patterns/formats, a tool list with anyOf
   over 5 tools, an e-commerce order), a regex and a GBNF grammar. llguidance's compile
   is pagellm's: grammar_from_json_schema with pagellm's JSON options (or grammar_from)
   plus the LLMatcher construction. xgrammar's is compile_json_schema / compile_regex /
   compile_grammar on a fresh GrammarCompiler with its cache disabled, with the same JSON
   language (one line, ", " and ": " separators, strict_mode off: additional properties
   follow the schema, as in llguidance). llguidance compiles lazily, so "first mask" (a
   fresh matcher's first bitmask) is reported too; "ready" = compile + first mask is what
   a request waits for before its first constrained token. Median of --repeats, the two
   engines alternating.
3. Per-step masks: B rows (1, 8, 32 over a mix of the schemas; 32 of one schema each)
   stepped --steps times. Every step both engines fill the bitmask (int32 [B, ceil(V/32)],
   the same layout in both) for the live rows of identical states: llguidance by a Python
   loop over the rows (llguidance.torch.fill_next_token_bitmask's call) and by
   LLExecutor.unsafe_compute_mask_ptr (pagellm's path, token_masks.fill_masks); xgrammar by
   a loop of GrammarMatcher.fill_next_token_bitmask and by BatchGrammarMatcher.
   batch_fill_next_token_bitmask. Then the bitmasks are applied to [B, V] float32 logits:
   pagellm's token_masks.apply_masks to llguidance's, xgr.apply_token_bitmask_inplace (its
   CPU kernel) to xgrammar's, and apply_masks to xgrammar's too (the apply step is not
   tied to the engine). Totals per step: llguidance's LLExecutor + apply_masks, xgrammar's
   faster fill + its own apply, and + apply_masks. The next tokens are the
   argmax of seeded random logits (tokens containing a quote get +--quote-bias, so strings
   close after a few tokens) under both engines' masks ANDed, so every matcher consumes
   the same tokens and both engines always see the same states; a row stops at EOS (and is
   then skipped by every variant) or when the engines' masks share no token. The variants
   run in a rotating order each step on separate matchers compiled separately, so one
   variant's lazily built state never serves another. Median / p90 / first step ms.
   Break-even: for each one-schema batch, after how many output tokens of a request
   xgrammar's per-token fill saving (if any) repays its longer compile + first mask.
4. Dependencies: each wheel's runtime requirements (importlib.metadata.requires), their
   installed closure and its size, what it adds to pagellm's core dependencies
   (pyproject.toml), and its import time in a fresh interpreter that has torch loaded.

Prints the configuration, the CPU, tables and one JSON line; writes
benchmarks/results/structured_backends.json (the JSON line) and .md (the tables). Without
xgrammar installed it measures llguidance alone and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from pagellm.bench.results import write_result_files
from pagellm.bench.machine import cpu_info, describe_cpu
from pagellm.metrics.ceilings import measure_bandwidth
from pagellm.workload import latency

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_OUT = RESULTS / "structured_backends.json"
# pagellm's JSON options (pagellm/structured/grammar_compiler.py) and xgrammar's equivalent.
LLG_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
XGR_JSON_OPTIONS = {"any_whitespace": False, "separators": (", ", ": "), "strict_mode": False}
FILL_VARIANTS = ("llg_loop", "llg_executor", "xgr_loop", "xgr_batch")
# llg_apply: pagellm's apply_masks on llguidance's bitmask; xgr_apply: xgrammar's kernel on its
# own; xgr_mask_apply_masks: pagellm's apply_masks on xgrammar's bitmask (the layouts match).
APPLY_VARIANTS = ("llg_apply", "xgr_apply", "xgr_mask_apply_masks")
QUICK = {"steps": 6, "repeats": 2, "setup_repeats": 1, "batch_sizes": [1, 8, 32], "same_schema": ["tool_calls"]}
FULL = {"steps": 30, "repeats": 5, "setup_repeats": 3, "batch_sizes": [1, 8, 32], "same_schema": None}


# -- the constraints ------------------------------------------------------------------------


def _obj(properties: dict[str, Any], required: Iterable[str] | None = None, **extra: Any) -> dict[str, Any]:
    """An object schema closed to other keys (as strict function-calling schemas are)."""
    return {"type": "object", "properties": properties, "required": list(required if required is not None
            else properties), "additionalProperties": False, **extra}  # fmt: skip


_STR, _INT, _NUM, _BOOL = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}
_ADDRESS = _obj({"street": _STR, "city": _STR, "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                 "country": {"enum": ["US", "CA", "GB", "DE", "FR", "JP"]}})  # fmt: skip


def _tool(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return _obj({"name": {"const": name}, "arguments": arguments})


# name -> (schema, an instance it accepts). Order matters: mixed batches cycle through it.
SCHEMAS: dict[str, tuple[dict[str, Any], Any]] = {
    "tool_calls": (
        {"anyOf": [
            _tool("get_weather", _obj({"city": _STR, "unit": {"enum": ["celsius", "fahrenheit"]}}, ["city"])),
            _tool("search_web", _obj({"query": _STR, "max_results": {"type": "integer", "minimum": 1,
                                                                      "maximum": 20}}, ["query"])),
            _tool("send_email", _obj({"to": {"type": "array", "items": {"type": "string", "format": "email"},
                                             "minItems": 1, "maxItems": 5},
                                      "subject": _STR, "body": _STR, "cc": {"type": "array", "items": _STR}},
                                     ["to", "subject", "body"])),
            _tool("create_event", _obj({"title": _STR, "start": {"type": "string", "format": "date-time"},
                                        "duration_minutes": {"type": "integer", "minimum": 5, "maximum": 480},
                                        "attendees": {"type": "array", "items": _STR, "maxItems": 10},
                                        "location": {"anyOf": [_STR, {"type": "null"}]}},
                                       ["title", "start", "duration_minutes"])),
            _tool("convert_currency", _obj({"amount": {"type": "number", "exclusiveMinimum": 0},
                                            "from": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                            "to": {"type": "string", "pattern": "^[A-Z]{3}$"}})),
        ]},
        {"name": "send_email", "arguments": {"to": ["ann@example.com"], "subject": "Hi", "body": "See you."}},
    ),
    "flat": (
        _obj({"name": _STR, "age": _INT, "active": _BOOL, "score": _NUM}, ["name", "age"]),
        {"name": "Ann", "age": 31, "active": True, "score": 4.5},
    ),
    "nested": (
        _obj({"user": _obj({"id": _INT, "name": _STR, "address": _ADDRESS}),
              "settings": _obj({"theme": {"enum": ["light", "dark"]},
                                "notifications": _obj({"email": _BOOL, "sms": _BOOL, "push": _BOOL})})}),
        {"user": {"id": 7, "name": "Bo", "address": {"street": "1 Main St", "city": "Springfield", "zip": "12345",
                                                      "country": "US"}},
         "settings": {"theme": "dark", "notifications": {"email": True, "sms": False, "push": True}}},
    ),
    "arrays_refs": (
        {"$defs": {"point": _obj({"x": _NUM, "y": _NUM}),
                   "segment": _obj({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}})},
         **_obj({"points": {"type": "array", "items": {"$ref": "#/$defs/point"}, "minItems": 2, "maxItems": 6},
                 "segments": {"type": "array", "items": {"$ref": "#/$defs/segment"}, "maxItems": 3},
                 "labels": {"type": "array", "items": _STR, "minItems": 1, "maxItems": 4}})},
        {"points": [{"x": 0, "y": 1.5}, {"x": 2, "y": -3}], "segments": [], "labels": ["a"]},
    ),
    "enums": (
        _obj({"status": {"enum": ["pending", "approved", "rejected", "cancelled", "on_hold"]},
              "priority": {"enum": [1, 2, 3, 4, 5]},
              "category": {"enum": ["billing", "technical", "account", "shipping", "returns", "sales", "legal",
                                    "security", "feedback", "other"]},
              "flag": {"enum": [True, False, None]}, "version": {"const": "v2"}}),
        {"status": "approved", "priority": 2, "category": "shipping", "flag": None, "version": "v2"},
    ),
    "bounded_numbers": (
        _obj({"age": {"type": "integer", "minimum": 0, "maximum": 150},
              "temperature": {"type": "number", "minimum": -50, "maximum": 60},
              "percent": {"type": "number", "minimum": 0, "maximum": 100},
              "count": {"type": "integer", "minimum": 1},
              "ratio": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}}),
        {"age": 42, "temperature": 21.5, "percent": 99.9, "count": 3, "ratio": 0.25},
    ),
    "string_formats": (
        _obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
              "email": {"type": "string", "format": "email"},
              "created": {"type": "string", "format": "date-time"},
              "day": {"type": "string", "format": "date"},
              "id": {"type": "string", "format": "uuid"},
              "code": {"type": "string", "minLength": 4, "maxLength": 8},
              "phone": {"type": "string", "pattern": "^\\+?[0-9]{7,15}$"}}),
        {"sku": "ABC-1234", "email": "a.b@example.com", "created": "2024-05-01T12:30:00Z", "day": "2024-05-01",
         "id": "123e4567-e89b-12d3-a456-426614174000", "code": "x1y2z", "phone": "+15551234567"},
    ),
    "ecommerce_order": (
        {"$defs": {
            "money": _obj({"amount": {"type": "number", "minimum": 0}, "currency": {"enum": ["USD", "EUR", "GBP"]}}),
            "address": _ADDRESS,
            "item": _obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "name": _STR,
                          "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                          "unit_price": {"$ref": "#/$defs/money"},
                          "options": {"type": "array", "items": _obj({"key": _STR, "value": _STR}), "maxItems": 3}},
                         ["sku", "quantity", "unit_price"])},
         **_obj({
             "order_id": {"type": "string", "pattern": "^ORD-[0-9]{8}$"},
             "created_at": {"type": "string", "format": "date-time"},
             "status": {"enum": ["new", "paid", "packed", "shipped", "delivered", "cancelled", "refunded"]},
             "customer": _obj({"id": _INT, "name": _STR, "email": {"type": "string", "format": "email"},
                               "loyalty_tier": {"enum": ["none", "silver", "gold", "platinum"]}}, ["id", "name"]),
             "shipping_address": {"$ref": "#/$defs/address"},
             "billing_address": {"anyOf": [{"$ref": "#/$defs/address"}, {"type": "null"}]},
             "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 20},
             "discounts": {"type": "array", "maxItems": 3, "items": {"anyOf": [
                 _obj({"kind": {"const": "percent"}, "value": {"type": "number", "minimum": 0, "maximum": 100}}),
                 _obj({"kind": {"const": "fixed"}, "value": {"$ref": "#/$defs/money"}}),
                 _obj({"kind": {"const": "coupon"}, "code": {"type": "string", "pattern": "^[A-Z0-9]{6,10}$"}})]}},
             "payment": {"anyOf": [
                 _obj({"method": {"const": "card"}, "brand": {"enum": ["visa", "mastercard", "amex"]},
                       "last4": {"type": "string", "pattern": "^[0-9]{4}$"}}),
                 _obj({"method": {"const": "paypal"}, "payer_email": {"type": "string", "format": "email"}}),
                 _obj({"method": {"const": "invoice"}, "due_days": {"type": "integer", "minimum": 0,
                                                                   "maximum": 90}})]},
             "total": {"$ref": "#/$defs/money"},
             "notes": {"anyOf": [_STR, {"type": "null"}]}},
             ["order_id", "created_at", "status", "customer", "shipping_address", "items", "payment", "total"])},
        {"order_id": "ORD-00001234", "created_at": "2024-05-01T12:30:00Z", "status": "paid",
         "customer": {"id": 9, "name": "Cy"},
         "shipping_address": {"street": "2 Elm", "city": "Oslo", "zip": "01234", "country": "DE"},
         "items": [{"sku": "ABC-0001", "quantity": 2, "unit_price": {"amount": 9.5, "currency": "EUR"}}],
         "payment": {"method": "card", "brand": "visa", "last4": "4242"},
         "total": {"amount": 19, "currency": "EUR"}},
    ),
}  # fmt: skip
REGEX = (r"[a-z0-9._%+-]{1,32}@[a-z0-9-]{1,32}(\.[a-z0-9-]{1,32}){0,3}\.[a-z]{2,6}", "ann.lee+news@mail.example.org")
# A small SQL-like grammar in GBNF, which both engines read (xgrammar calls it EBNF).
GBNF = (r'''root ::= "SELECT " columns " FROM " ident where? limit? ";"
columns ::= "*" | ident (", " ident)*
where ::= " WHERE " cond (" AND " cond)*
cond ::= ident " " op " " value
op ::= "=" | "!=" | "<" | "<=" | ">" | ">="
value ::= number | "'" [a-zA-Z0-9 _-]* "'"
limit ::= " LIMIT " [1-9] [0-9]*
number ::= "-"? [0-9]+ ("." [0-9]+)?
ident ::= [a-z_] [a-z0-9_]*
''', "SELECT id, name FROM users WHERE age >= 18 AND city = 'Oslo' LIMIT 10;")  # fmt: skip


def constraints() -> list[tuple[str, str, str, str]]:
    """(name, kind, text, an output it accepts) for every constraint: kind json / regex / grammar."""
    out = [(name, "json", json.dumps(schema), json.dumps(sample, separators=(", ", ": ")))
           for name, (schema, sample) in SCHEMAS.items()]  # fmt: skip
    return out + [("email_regex", "regex", *REGEX), ("sql_gbnf", "grammar", *GBNF)]


# -- pure helpers (tests/bench/test_structured_backends.py) --------------------------------


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) of unsorted values, as every report computes it."""
    if not values:
        raise ValueError("percentile of no values")
    return latency.percentile(sorted(values), q)


def summarize_ms(seconds: list[float]) -> dict[str, float]:
    """median / p90 / mean / first / max of timings in seconds, as milliseconds."""
    ms = [s * 1e3 for s in seconds]
    return {"median": round(statistics.median(ms), 4), "p90": round(percentile(ms, 90), 4),
            "mean": round(statistics.fmean(ms), 4), "first": round(ms[0], 4), "max": round(max(ms), 4)}  # fmt: skip


def mixed_rows(names: list[str], batch_size: int) -> list[str]:
    """The schema of each row of a mixed batch: the corpus in order, repeated."""
    return [names[i % len(names)] for i in range(batch_size)]


def rotate(items: tuple[str, ...], step: int) -> list[str]:
    """`items` starting at position step % len: each variant leads in turn."""
    k = step % len(items)
    return list(items[k:] + items[:k])


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def dependency_closure(
    name: str, requires: Callable[[str], list[str] | None], marker_env: dict[str, str] | None = None
) -> list[str]:
    """The canonical names of `name`'s runtime dependencies, transitively (without `name`;
    requirements behind an extra or a false marker left out; `requires(name)` is None for a
    package that is not installed, which then adds nothing further)."""
    from packaging.requirements import Requirement

    env = {"extra": "", **(marker_env or {})}
    seen: set[str] = set()
    todo = [canonical(name)]
    while todo:
        for text in requires(todo.pop()) or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            dep = canonical(req.name)
            if dep not in seen and dep != canonical(name):
                seen.add(dep)
                todo.append(dep)
    return sorted(seen)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}" if abs(value) >= 1 else f"{value:.3g}"
    return str(value)


def markdown_table(header: list[str], rows: list[list[Any]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(_cell(c) for c in row) + " |" for row in rows)]  # fmt: skip


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return round(numerator / denominator, 2)


# -- the engines --------------------------------------------------------------------------


class Engines:
    """Both grammar engines over one tokenizer (xgrammar None where it is not installed)."""

    def __init__(self, tokenizer: Any, vocab_size: int, threads: int) -> None:
        import llguidance

        self.llguidance = llguidance
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.eos_token_ids = sorted(tokenizer.eos_token_ids)
        self.threads = threads
        self.executor = llguidance.LLExecutor(num_threads=threads)
        try:
            import xgrammar
        except ImportError:
            xgrammar = None
        self.xgr = xgrammar
        self.xgr_batch = None
        if xgrammar is not None and hasattr(xgrammar, "BatchGrammarMatcher"):
            self.xgr_batch = xgrammar.BatchGrammarMatcher(max_threads=threads)
        self.ll_tokenizer: Any = None
        self.xgr_info: Any = None

    # Tokenizer setup --------------------------------------------------------------------

    def setup_llg(self) -> float:
        start = time.perf_counter()
        self.ll_tokenizer = self.llguidance.LLTokenizer(
            self.tokenizer.backend.to_str(), n_vocab=self.vocab_size, eos_token=self.eos_token_ids
        )
        return time.perf_counter() - start

    def setup_xgr(self) -> tuple[float, float]:
        """(seconds to wrap the tokenizer for transformers, seconds for TokenizerInfo)."""
        from transformers import PreTrainedTokenizerFast

        start = time.perf_counter()
        wrapped = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer.backend)
        middle = time.perf_counter()
        self.xgr_info = self.xgr.TokenizerInfo.from_huggingface(
            wrapped, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids
        )
        return middle - start, time.perf_counter() - middle

    # Compiling --------------------------------------------------------------------------

    def llg_compile(self, kind: str, text: str) -> Any:
        """An LLMatcher, as pagellm's GrammarCompiler._compile builds it."""
        llg = self.llguidance
        if kind == "json":
            grammar = llg.LLMatcher.grammar_from_json_schema(text, defaults=LLG_JSON_OPTIONS)
        else:
            grammar = llg.grammar_from(kind, text)
        matcher = llg.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise RuntimeError(f"llguidance cannot compile this {kind}: {matcher.get_error()}")
        return matcher

    def xgr_compiler(self) -> Any:
        """A fresh GrammarCompiler without a cache (built before a compile is timed)."""
        return self.xgr.GrammarCompiler(self.xgr_info, max_threads=self.threads, cache_enabled=False)

    def xgr_compile(self, compiler: Any, kind: str, text: str) -> Any:
        """A CompiledGrammar: the same JSON language as llguidance's (XGR_JSON_OPTIONS)."""
        if kind == "json":
            return compiler.compile_json_schema(text, **XGR_JSON_OPTIONS)
        if kind == "regex":
            return compiler.compile_regex(text)
        return compiler.compile_grammar(text)

    def new_bitmask(self, rows: int) -> torch.Tensor:
        return torch.full((rows, self.words), -1, dtype=torch.int32)  # [rows, ceil(V / 32)]

    def llg_fill_one(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        # llguidance.torch.fill_next_token_bitmask without its asserts: importing that
        # module costs ~1.7 s (its torch.compile decorator loads dynamo), pagellm never does.
        matcher.unsafe_compute_mask_ptr(bitmask.data_ptr() + row * self.words * 4, self.words * 4)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.backend.encode(text, add_special_tokens=False).ids


def measure_setup(engines: Engines, repeats: int) -> dict[str, Any]:
    llg, xgr_wrap, xgr_info = [], [], []
    for r in range(repeats):
        for name in ("llg", "xgr") if r % 2 == 0 else ("xgr", "llg"):
            if name == "llg":
                llg.append(engines.setup_llg())
            elif engines.xgr is not None:
                wrap, info = engines.setup_xgr()
                xgr_wrap.append(wrap)
                xgr_info.append(info)
    out: dict[str, Any] = {"llg_s": round(statistics.median(llg), 4)}
    if xgr_info:
        out |= {"xgr_s": round(statistics.median(a + b for a, b in zip(xgr_wrap, xgr_info)), 4),
                "xgr_wrap_s": round(statistics.median(xgr_wrap), 4),
                "xgr_tokenizer_info_s": round(statistics.median(xgr_info), 4)}  # fmt: skip
    return out


def accepts_llg(engines: Engines, kind: str, text: str, sample: str) -> bool:
    matcher = engines.llg_compile(kind, text)
    tokens = engines.encode(sample)
    return matcher.try_consume_tokens(tokens) == len(tokens) and matcher.is_accepting()


def accepts_xgr(engines: Engines, kind: str, text: str, sample: str) -> bool:
    matcher = engines.xgr.GrammarMatcher(engines.xgr_compile(engines.xgr_compiler(), kind, text))
    tokens = engines.encode(sample) + engines.eos_token_ids[:1]
    return all(matcher.accept_token(t) for t in tokens) and matcher.is_terminated()


def measure_compiles(engines: Engines, repeats: int) -> list[dict[str, Any]]:
    rows = []
    bitmask = engines.new_bitmask(1)
    for name, kind, text, sample in constraints():
        times: dict[str, list[float]] = {"llg_compile": [], "llg_first_mask": [], "xgr_compile": [],
                                         "xgr_first_mask": []}  # fmt: skip
        for r in range(repeats):
            for engine in ("llg", "xgr") if r % 2 == 0 else ("xgr", "llg"):
                if engine == "llg":
                    start = time.perf_counter()
                    matcher = engines.llg_compile(kind, text)
                    middle = time.perf_counter()
                    engines.llg_fill_one(matcher, bitmask, 0)
                elif engines.xgr is not None:
                    compiler = engines.xgr_compiler()
                    start = time.perf_counter()
                    compiled = engines.xgr_compile(compiler, kind, text)
                    middle = time.perf_counter()
                    engines.xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
                else:
                    continue
                end = time.perf_counter()
                times[f"{engine}_compile"].append(middle - start)
                times[f"{engine}_first_mask"].append(end - middle)
        row: dict[str, Any] = {"name": name, "kind": kind, "chars": len(text),
                               "llg_accepts_sample": accepts_llg(engines, kind, text, sample)}  # fmt: skip
        if engines.xgr is not None:
            row["xgr_accepts_sample"] = accepts_xgr(engines, kind, text, sample)
        for key, values in times.items():
            if values:
                row[f"{key}_ms"] = round(statistics.median(values) * 1e3, 3)
        for engine in ("llg", "xgr"):
            if f"{engine}_compile_ms" in row:
                row[f"{engine}_ready_ms"] = round(row[f"{engine}_compile_ms"] + row[f"{engine}_first_mask_ms"], 3)
        row["xgr_over_llg_ready"] = ratio(row.get("xgr_ready_ms"), row.get("llg_ready_ms"))
        rows.append(row)
    return rows


# -- per-step masks -----------------------------------------------------------------------


def quote_bias(engines: Engines, bias: float) -> torch.Tensor:
    """[V] float32: `bias` on tokens whose text holds a double quote (byte-level BPE keeps
    printable ASCII as is), so random strings close after a few tokens."""
    vector = torch.zeros(engines.vocab_size)
    backend = engines.tokenizer.backend
    for token_id in range(engines.vocab_size):
        text = backend.id_to_token(token_id)
        if text is not None and '"' in text:
            vector[token_id] = bias
    return vector


def mask_agreement(llg: torch.Tensor, xgr: torch.Tensor, counts: dict[str, int]) -> bool:
    """Count each row of two bitmasks ([rows, words] int32) as identical, llg_subset (llguidance
    allows fewer tokens), xgr_subset or other, into `counts`; True when all rows are identical."""
    same = (llg == xgr).all(dim=1)
    llg_in_xgr = ((llg & ~xgr) == 0).all(dim=1)
    xgr_in_llg = ((xgr & ~llg) == 0).all(dim=1)
    counts["identical"] += int(same.sum())
    counts["llg_subset"] += int((llg_in_xgr & ~same).sum())
    counts["xgr_subset"] += int((xgr_in_llg & ~same).sum())
    counts["other"] += int((~llg_in_xgr & ~xgr_in_llg).sum())
    return bool(same.all())


def warm_up_apply(engines: Engines) -> None:
    """Run both apply functions once, untimed: torch's first call of an op costs ~1 ms."""
    from pagellm.structured.token_masks import apply_masks

    logits = torch.zeros(2, engines.vocab_size)  # [2, V]
    apply_masks(logits, engines.new_bitmask(2), [0, 1])
    if engines.xgr is not None:
        engines.xgr.apply_token_bitmask_inplace(logits, engines.new_bitmask(2), indices=[0, 1])


def run_batch(
    engines: Engines, rows: list[str], steps: int, seed: int, bias: torch.Tensor, mixed: bool
) -> dict[str, Any]:
    """Step B = len(rows) matchers (rows[i]: row i's schema) `steps` times; see the module doc.
    `mixed`: the rows cycle through the corpus (else they all share one schema)."""
    from pagellm.structured.token_masks import apply_masks

    xgr = engines.xgr
    batch_size = len(rows)
    texts = {name: json.dumps(SCHEMAS[name][0]) for name in set(rows)}
    variants = [v for v in FILL_VARIANTS if v.startswith("llg") or (xgr is not None and
                (v == "xgr_loop" or engines.xgr_batch is not None))]  # fmt: skip
    matchers: dict[str, list[Any]] = {}
    for variant in variants:  # each variant compiles its own: no lazily built state is shared
        if variant.startswith("llg"):
            templates = {n: engines.llg_compile("json", t) for n, t in texts.items()}
            matchers[variant] = [templates[n].deep_copy() for n in rows]
        else:
            compiled = {n: engines.xgr_compile(engines.xgr_compiler(), "json", t) for n, t in texts.items()}
            matchers[variant] = [xgr.GrammarMatcher(compiled[n]) for n in rows]
    bitmasks = {v: engines.new_bitmask(batch_size) for v in variants}
    words = engines.words

    def fill(variant: str, live: list[int], bitmask: torch.Tensor) -> None:
        ms = matchers[variant]
        if variant == "llg_loop":
            for i in live:
                engines.llg_fill_one(ms[i], bitmask, i)
        elif variant == "llg_executor":  # token_masks.fill_masks' call
            engines.executor.unsafe_compute_mask_ptr([(ms[i], i) for i in live], bitmask.data_ptr(), words * 4,
                                                     batch_size)  # fmt: skip
        elif variant == "xgr_loop":
            for i in live:
                ms[i].fill_next_token_bitmask(bitmask, i)
        else:
            engines.xgr_batch.batch_fill_next_token_bitmask([ms[i] for i in live], bitmask, indices=live)

    apply_variants = ["llg_apply"] + (["xgr_apply", "xgr_mask_apply_masks"] if xgr is not None else [])
    xgr_fill = "xgr_batch" if "xgr_batch" in variants else "xgr_loop"  # xgrammar's mask for choosing tokens

    def apply(variant: str, logits: torch.Tensor, live: list[int]) -> None:
        if variant == "llg_apply":
            apply_masks(logits, bitmasks["llg_executor"], live)
        elif variant == "xgr_apply":
            xgr.apply_token_bitmask_inplace(logits, bitmasks[xgr_fill], indices=live)
        else:
            apply_masks(logits, bitmasks[xgr_fill], live)

    fill_s: dict[str, list[float]] = {v: [] for v in variants}
    apply_s: dict[str, list[float]] = {v: [] for v in apply_variants}
    live_rows: list[int] = []
    agreement = {"identical": 0, "llg_subset": 0, "xgr_subset": 0, "other": 0}
    finished = disagreed = 0
    apply_identical = True
    done = [False] * batch_size
    generator = torch.Generator().manual_seed(seed)
    for step in range(steps):
        live = [i for i in range(batch_size) if not done[i]]
        if not live:
            break
        live_rows.append(len(live))
        for variant in rotate(tuple(variants), step):
            bitmask = bitmasks[variant]
            bitmask.fill_(-1)
            start = time.perf_counter()
            fill(variant, live, bitmask)
            fill_s[variant].append(time.perf_counter() - start)
        for a, b in (("llg_loop", "llg_executor"), ("xgr_loop", "xgr_batch")):
            if a in bitmasks and b in bitmasks and not torch.equal(bitmasks[a][live], bitmasks[b][live]):
                raise RuntimeError(f"{a} and {b} filled different masks at step {step}")
        logits = torch.randn(batch_size, engines.vocab_size, generator=generator) + bias  # [B, V]
        results = {}
        for variant in rotate(tuple(apply_variants), step):
            masked = logits.clone()
            start = time.perf_counter()
            apply(variant, masked, live)
            apply_s[variant].append(time.perf_counter() - start)
            results[variant] = masked
        combined = bitmasks["llg_executor"].clone()
        if xgr is not None:
            mask_agreement(bitmasks["llg_executor"][live], bitmasks[xgr_fill][live], agreement)
            combined &= bitmasks[xgr_fill]
            apply_identical &= torch.equal(results["xgr_apply"], results["xgr_mask_apply_masks"])
        chosen = logits.clone()
        apply_masks(chosen, combined, live)
        tokens = chosen.argmax(dim=-1).tolist()
        for i in live:
            token = tokens[i]
            if chosen[i, token] == float("-inf"):
                done[i] = True  # the engines allow no common token
                disagreed += 1
                continue
            for variant in variants:
                m = matchers[variant][i]
                if variant.startswith("llg"):
                    ok = m.consume_token(token) or (m.is_stopped() and token in engines.eos_token_ids)
                else:
                    ok = m.accept_token(token)
                if not ok:
                    raise RuntimeError(f"{variant} rejected token {token} that its mask allowed (row {i})")
            if token in engines.eos_token_ids:
                done[i] = True
                finished += 1
    totals = {"llg_total": [f + a for f, a in zip(fill_s["llg_executor"], apply_s["llg_apply"])]}
    xgr_best = None
    if xgr is not None:  # xgrammar's faster fill here (by median) + its apply
        xgr_best = min((v for v in variants if v.startswith("xgr")), key=lambda v: statistics.median(fill_s[v]))
        totals["xgr_total"] = [f + a for f, a in zip(fill_s[xgr_best], apply_s["xgr_apply"])]
        totals["xgr_total_apply_masks"] = [f + a for f, a in zip(fill_s[xgr_best], apply_s["xgr_mask_apply_masks"])]
    # An apply reads and writes each live row's logits and reads its bitmask row, at least.
    apply_bytes = statistics.fmean(live_rows) * (2 * engines.vocab_size * 4 + words * 4)
    return {
        "batch_size": batch_size, "mixed": mixed, "schemas": sorted(set(rows)), "steps": len(live_rows),
        "mean_live_rows": round(statistics.fmean(live_rows), 1), "rows_finished_eos": finished,
        "rows_stopped_disagreement": disagreed,
        "mask_agreement": {k: round(v / max(1, sum(agreement.values())), 4) for k, v in agreement.items()}
        if xgr is not None else None,
        "apply_results_identical": apply_identical if xgr is not None else None,
        "xgr_fill_for_total": xgr_best,
        "ms": {k: summarize_ms(v) for k, v in {**fill_s, **apply_s, **totals}.items()},
        "apply_bytes": round(apply_bytes),
        "apply_gb_s": {k: round(apply_bytes / statistics.median(v) / 1e9, 1) for k, v in apply_s.items()},
    }  # fmt: skip


# -- dependencies ---------------------------------------------------------------------------


def _requires(name: str) -> list[str] | None:
    import importlib.metadata as md

    try:
        return md.requires(name) or []
    except md.PackageNotFoundError:
        return None


def _installed_mb(names: Iterable[str]) -> float:
    import importlib.metadata as md

    total = 0
    for name in names:
        try:
            total += sum(f.size or 0 for f in md.distribution(name).files or [])
        except md.PackageNotFoundError:
            pass
    return round(total / 1e6, 1)


def import_seconds(package: str) -> float | None:
    """Seconds to import the package's module in a fresh interpreter that has imported torch
    already (as pagellm has)."""
    module = {"llguidance": "llguidance", "xgrammar": "xgrammar"}.get(package, package.replace("-", "_"))
    code = ("import time, torch; start = time.perf_counter(); import " + module
            + "; print(time.perf_counter() - start)")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        return None
    return round(float(done.stdout.strip().splitlines()[-1]), 3)


def measure_dependencies(packages: list[str]) -> list[dict[str, Any]]:
    """Each package's runtime requirements, installed closure, and what that adds to the
    closure of pagellm's core dependencies (pyproject.toml, without llguidance)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    from packaging.requirements import Requirement

    core = {canonical(Requirement(r).name) for r in project["dependencies"]} - {"llguidance"}
    core_closure = set(core)
    for name in core:
        core_closure |= set(dependency_closure(name, _requires))
    out = []
    for name in packages:
        requires = _requires(name)
        if requires is None:
            out.append({"package": name, "installed": False})
            continue
        import importlib.metadata as md

        closure = dependency_closure(name, _requires)
        added = [n for n in closure if n not in core_closure]
        out.append({
            "package": name, "installed": True, "version": md.version(name),
            "requires": [r for r in requires if "extra ==" not in r],
            "own_mb": _installed_mb([name]), "closure": closure, "closure_mb": _installed_mb(closure),
            "adds_to_pagellm_core": added, "adds_mb": _installed_mb(added), "import_s": import_seconds(name),
            "not_installed": [n for n in closure if _requires(n) is None],
        })  # fmt: skip
    return out


# -- report ---------------------------------------------------------------------------------


def geometric_mean(values: list[float]) -> float | None:
    values = [v for v in values if v and v > 0]
    if not values:
        return None
    return round(statistics.geometric_mean(values), 2)


def _spread(ms: dict[str, float] | None) -> str | None:
    """`median / p90 (first)` of a summarize_ms dict."""
    if ms is None:
        return None
    return f"{_cell(ms['median'])} / {_cell(ms['p90'])} ({_cell(ms['first'])})"


def verdict(results: dict[str, Any]) -> list[str]:
    """Which engine wins on what, from the results (empty without xgrammar)."""
    setup, compiles, steps = results["tokenizer_setup"], results["compile"], results["steps"]
    if "xgr_s" not in setup:
        return []
    out = []
    setup_ratio = setup["xgr_s"] / setup["llg_s"]
    faster = "about equal" if 0.9 < setup_ratio < 1.1 else "llguidance" if setup_ratio > 1 else "xgrammar"
    out.append(f"Tokenizer setup: {faster} (llguidance {setup['llg_s']} s, xgrammar {setup['xgr_s']} s with its "
               "transformers wrapper; once per server).")  # fmt: skip
    for key, what in (("compile", "compile alone"), ("ready", "compile + first mask")):
        ratios = [ratio(c[f"xgr_{key}_ms"], c[f"llg_{key}_ms"]) for c in compiles]
        wins = sum(1 for r in ratios if r is not None and r > 1)
        out.append(f"{what.capitalize()}: llguidance faster on {wins} of {len(compiles)} constraints; "
                   f"xgrammar / llguidance geometric mean {geometric_mean(ratios)}x.")  # fmt: skip
    for key, llg, xgr in (("fill (each engine's faster path)", ("llg_loop", "llg_executor"), ("xgr_loop", "xgr_batch")),
                          ("apply (each engine's own)", ("llg_apply",), ("xgr_apply",)),
                          ("fill + own apply", ("llg_total",), ("xgr_total",)),
                          ("fill + apply_masks for both", ("llg_total",), ("xgr_total_apply_masks",))):  # fmt: skip
        pairs = [(min(s["ms"][v]["median"] for v in llg if v in s["ms"]),
                  min(s["ms"][v]["median"] for v in xgr if v in s["ms"]))
                 for s in steps if any(v in s["ms"] for v in xgr)]  # fmt: skip
        if not pairs:
            continue
        wins = sum(1 for a, b in pairs if a < b)
        ratios = [ratio(b, a) for a, b in pairs]
        out.append(f"Per-step {key}, median ms: llguidance faster in {wins} of {len(pairs)} batches; "
                   f"xgrammar / llguidance geometric mean {geometric_mean(ratios)}x.")  # fmt: skip
    if results["break_even"]:
        tokens = sorted(b["tokens"] for b in results["break_even"] if b["tokens"] is not None)
        slower = [b["schema"] for b in results["break_even"] if b["tokens"] is None]
        if tokens:
            out.append(f"Break-even (B={results['break_even'][0]['batch_size']}, one schema per batch): xgrammar's "
                       f"faster fill repays its longer compile after {tokens[0]}-{tokens[-1]} output tokens "
                       f"(median {statistics.median(tokens):.0f}) of a request whose schema missed the cache"
                       + (f"; never for {', '.join(slower)}" if slower else "") + ".")  # fmt: skip
    deps = {d["package"]: d for d in results["dependencies"] if d.get("installed")}
    if "llguidance" in deps and "xgrammar" in deps:
        x = deps["xgrammar"]
        out.append(f"Dependencies: llguidance requires {len(deps['llguidance']['closure'])} packages; xgrammar "
                   f"{len(x['closure'])} ({x['closure_mb']} MB installed), adding {len(x['adds_to_pagellm_core'])} "
                   f"to pagellm's core ({', '.join(x['adds_to_pagellm_core'])}: {x['adds_mb']} MB).")  # fmt: skip
    return out


def break_even(compiles: list[dict[str, Any]], steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each one-schema batch: the output tokens per request after which xgrammar's
    per-step fill saving (each engine's faster fill, per live row) repays its longer
    compile + first mask (None where xgrammar's fill is not faster)."""
    ready = {c["name"]: c for c in compiles}
    out = []
    for s in steps:
        if s["mixed"] or "xgr_loop" not in s["ms"] or s["schemas"][0] not in ready:
            continue
        name, ms = s["schemas"][0], s["ms"]
        llg = min(ms[v]["median"] for v in ("llg_loop", "llg_executor"))
        xgr = min(ms[v]["median"] for v in ("xgr_loop", "xgr_batch") if v in ms)
        saving = (llg - xgr) / s["mean_live_rows"]  # ms per row per step
        extra = ready[name]["xgr_ready_ms"] - ready[name]["llg_ready_ms"]
        out.append({"schema": name, "batch_size": s["batch_size"], "extra_compile_ms": round(extra, 3),
                    "fill_saving_us_per_token": round(saving * 1e3, 3),
                    "tokens": round(extra / saving) if saving > 0 else None})  # fmt: skip
    return out


def format_tables(record: dict[str, Any]) -> str:
    results = record["results"]
    have_xgr = record["config"]["xgrammar"] is not None
    setup = results["tokenizer_setup"]
    lines = ["Tokenizer setup (median seconds):", ""]
    lines += markdown_table(
        ["engine", "seconds", "detail"],
        [["llguidance LLTokenizer", setup["llg_s"], "from the tokenizers JSON string"]]
        + ([["xgrammar TokenizerInfo", setup["xgr_s"], (f"transformers wrapper {setup['xgr_wrap_s']} s + "
             f"from_huggingface {setup['xgr_tokenizer_info_s']} s")]] if have_xgr else []),
    )  # fmt: skip
    lines += ["", "Compile (median ms; first mask = a fresh matcher's first bitmask; ready = the two):", ""]
    lines += markdown_table(
        ["constraint", "kind", "chars", "llg compile", "llg 1st mask", "llg ready", "xgr compile", "xgr 1st mask",
         "xgr ready", "xgr/llg ready", "sample accepted llg/xgr"],
        [[c["name"], c["kind"], c["chars"], c.get("llg_compile_ms"), c.get("llg_first_mask_ms"), c.get("llg_ready_ms"),
          c.get("xgr_compile_ms"), c.get("xgr_first_mask_ms"), c.get("xgr_ready_ms"), c.get("xgr_over_llg_ready"),
          f"{c['llg_accepts_sample']}/{c.get('xgr_accepts_sample', '-')}"] for c in results["compile"]],
    )  # fmt: skip
    steps = results["steps"]
    lines += ["", "Per-step bitmask fill for the live rows (ms: median / p90 (first step)):", ""]
    lines += markdown_table(
        ["B", "schemas", "steps", "live rows", "llg loop", "llg LLExecutor", "xgr loop", "xgr batch",
         "masks same / llg<xgr / xgr<llg / other"],
        [[s["batch_size"], _schemas_label(s), s["steps"], s["mean_live_rows"],
          *(_spread(s["ms"].get(v)) for v in FILL_VARIANTS),
          " / ".join(f"{v:.0%}" for v in s["mask_agreement"].values()) if s["mask_agreement"] else None]
         for s in steps],
    )  # fmt: skip
    lines += ["", ("Per-step mask apply to [B, V] float32 logits, and fill + apply per engine "
                   "(ms: median / p90 (first step)):"), ""]  # fmt: skip
    copy = results.get("copy_bandwidth_gb_s")
    lines += markdown_table(
        ["B", "schemas", "apply_masks (llg mask)", "xgr apply_token_bitmask_inplace", "apply_masks (xgr mask)",
         "llg total (LLExecutor + apply_masks)", "xgr total (faster fill + its apply)",
         "xgr total (faster fill + apply_masks)", "xgr/llg total: own apply / apply_masks"],
        [[s["batch_size"], _schemas_label(s), _spread(s["ms"]["llg_apply"]),
          _spread(s["ms"].get("xgr_apply")), _spread(s["ms"].get("xgr_mask_apply_masks")),
          _spread(s["ms"]["llg_total"]),
          f"{_spread(s['ms']['xgr_total'])} [{s['xgr_fill_for_total']}]" if "xgr_total" in s["ms"] else None,
          _spread(s["ms"].get("xgr_total_apply_masks")),
          " / ".join(_cell(ratio(s["ms"].get(k, {}).get("median"), s["ms"]["llg_total"]["median"]))
                     for k in ("xgr_total", "xgr_total_apply_masks"))] for s in steps],
    )  # fmt: skip
    lines += ["", (f"Apply traffic: each live row's logits read and written plus its bitmask row, over the median "
                   f"time, against a large copy's {copy} GB/s (logits of B=32 are 6.3 MB: caches help):"), ""]
    lines += markdown_table(
        ["B", "schemas", "MB per apply", "apply_masks GB/s (llg mask)", "xgr apply GB/s",
         "apply_masks GB/s (xgr mask)"],
        [[s["batch_size"], _schemas_label(s), round(s["apply_bytes"] / 1e6, 2),
          *(s["apply_gb_s"].get(v) for v in APPLY_VARIANTS)] for s in steps],
    )  # fmt: skip
    lines += ["", "Dependencies (runtime requirements; closure = installed transitive requirements):", ""]
    lines += markdown_table(
        ["package", "version", "requires", "own MB", "closure", "closure MB", "adds to pagellm core", "adds MB",
         "import s (after torch)"],
        [[d["package"], d.get("version", "not installed"), ", ".join(d.get("requires", [])) or "nothing",
          d.get("own_mb"), len(d.get("closure", [])), d.get("closure_mb"),
          ", ".join(d.get("adds_to_pagellm_core", [])) or "nothing", d.get("adds_mb"), d.get("import_s")]
         for d in results["dependencies"]],
    )  # fmt: skip
    if results["verdict"]:
        lines += ["", "Who wins:", *(f"- {line}" for line in results["verdict"])]
    lines += ["", "Notes:", *(f"- {note}" for note in record["notes"])]
    return "\n".join(lines) + "\n"


def _schemas_label(step: dict[str, Any]) -> str:
    """The schema of a one-schema batch; `mixed (n)` (or the names, when few) otherwise."""
    schemas = step["schemas"]
    if not step["mixed"]:
        return schemas[0]
    return f"mixed ({', '.join(schemas)})" if len(schemas) < 3 else f"mixed ({len(schemas)})"


def notes(record: dict[str, Any]) -> list[str]:
    config, results = record["config"], record["results"]
    out = []
    if config["xgrammar"] is None:
        out.append("xgrammar is not installed: llguidance alone was measured (pip install xgrammar to compare).")
    else:
        out.append(f"Both engines get {config['threads']} threads (LLExecutor num_threads, BatchGrammarMatcher "
                   "and GrammarCompiler max_threads); llguidance compiles on the calling thread. pagellm's "
                   "fill_masks uses LLExecutor() (its default: 80% of the CPUs, up to 32).")  # fmt: skip
        if results["xgr_fill"] != "xgr_batch":
            out.append("This xgrammar has no BatchGrammarMatcher: only its per-matcher loop was timed.")
        out.append("Both engines' bitmasks have the same layout (bit j of int32 word w = token 32w + j), so the "
                   "apply step is not tied to the engine: pagellm's apply_masks serves either. The fill is the "
                   "engine's own work.")  # fmt: skip
        out.append("Masks differ where the engines define the language differently; llg<xgr: llguidance "
                   "allowed a strict subset (it allows only the canonical tokenization of text the grammar "
                   "forces, e.g. a key's name, and no special tokens such as <|im_start|> inside JSON strings, "
                   "where xgrammar allows both); xgr<llg: e.g. llguidance allows the integer -0, xgrammar not. "
                   "Tokens are drawn from both masks ANDed.")  # fmt: skip
        out.append("The parallel fills (LLExecutor, BatchGrammarMatcher) hand rows to threads every step; on this "
                   "machine's few shared cores they gain little over the engine's own loop or lose to it, and "
                   "spike (see their p90). Machines with many cores were not measured.")  # fmt: skip
        if any(s["rows_stopped_disagreement"] for s in results["steps"]):
            out.append("Some rows stopped because the engines' masks shared no token (see rows_stopped_disagreement).")
        if any(s["apply_results_identical"] is False for s in results["steps"]):
            out.append("WARNING: the two apply functions gave different logits for identical masks.")
    for c in results["compile"]:
        rejected = [e for e in ("llg", "xgr") if c.get(f"{e}_accepts_sample") is False]
        if c["name"] == "sql_gbnf" and rejected == ["llg"]:
            out.append(f"llguidance rejects sql_gbnf's sample ({GBNF[1]!r}) at ' LIMIT': its GBNF import turns a "
                       "rule made only of terminals (where) into one greedy lexeme, which after a condition takes "
                       "' ' as the start of ' AND ' (a WHERE clause alone, or LIMIT alone, is accepted). GBNF "
                       "written for a character-level engine can need rewriting for llguidance.")  # fmt: skip
        elif rejected:
            out.append(f"{' and '.join(rejected)} rejected {c['name']}'s sample output (see the compile table).")
    out.append("Compile times are single-request latencies on a fresh compiler; pagellm caches compiled "
               "constraints, so a repeated schema costs neither engine this again.")  # fmt: skip
    load = config["load_average_before"][0]
    if load > 0.5 * config["cpu_count"]:
        out.append(f"The machine was busy before the run (1-minute load {load} on {config['cpu_count']} cores): "
                   "expect noisy figures; the engines alternate, so their ratios hold better than the times.")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="llguidance against xgrammar for structured outputs: tokenizer setup, compile times over a "
        "corpus of JSON schemas, a regex and a GBNF grammar, per-step mask fill and apply at several batch sizes, "
        "and dependency footprint.",
    )
    parser.add_argument("--model", default=None, help="model whose tokenizer to use (default: the embedded SmolLM2)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: " + json.dumps(QUICK))
    parser.add_argument("--steps", type=int, default=None, help=f"decode steps per batch ({FULL['steps']})")
    parser.add_argument("--repeats", type=int, default=None, help=f"compiles per constraint ({FULL['repeats']})")
    parser.add_argument("--setup-repeats", type=int, default=None,
                        help=f"tokenizer setups per engine ({FULL['setup_repeats']})")  # fmt: skip
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                        help=f"batch sizes of the mixed-schema batches ({FULL['batch_sizes']})")  # fmt: skip
    parser.add_argument("--same-schema", nargs="*", default=None, choices=sorted(SCHEMAS),
                        help="schemas to also step alone at the largest batch size (default: all)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="threads for both engines' parallel paths (default: the usable CPUs, %(default)s)")
    parser.add_argument("--quote-bias", type=float, default=1.0,
                        help="logit bonus of tokens with a double quote (%(default)s)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="JSON file; the tables go beside it as .md (%(default)s)")  # fmt: skip
    args = parser.parse_args(argv)
    preset = QUICK if args.quick else FULL
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.same_schema is None:
        args.same_schema = list(SCHEMAS)
    if args.threads < 1 or args.steps < 1 or args.repeats < 1 or args.setup_repeats < 1:
        parser.error("--threads, --steps, --repeats and --setup-repeats must be at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import importlib.metadata as md

    from pagellm.model.loader import (
        load_model_config,
        load_tokenizer,
        resolve_model_source,
    )

    started = time.perf_counter()
    source = resolve_model_source(args.model)
    model_config = load_model_config(source)
    tokenizer = load_tokenizer(source, model_config)
    engines = Engines(tokenizer, model_config.vocab_size, args.threads)
    cpu = cpu_info()
    config = {
        "model": args.model or "embedded SmolLM2", "vocab_size": engines.vocab_size,
        "eos_token_ids": engines.eos_token_ids, "llguidance": md.version("llguidance"),
        "xgrammar": md.version("xgrammar") if engines.xgr is not None else None, "torch": torch.__version__,
        "threads": args.threads, "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "steps": args.steps, "repeats": args.repeats, "setup_repeats": args.setup_repeats,
        "batch_sizes": args.batch_sizes, "same_schema": args.same_schema, "quote_bias": args.quote_bias,
        "seed": args.seed, "quick": args.quick, "load_average_before": [round(x, 2) for x in os.getloadavg()],
    }  # fmt: skip
    print("config:", ", ".join(f"{k}={v}" for k, v in config.items()))
    print("cpu:", describe_cpu(cpu))
    if engines.xgr is None:
        print("xgrammar is not installed: measuring llguidance alone")
    results: dict[str, Any] = {"tokenizer_setup": measure_setup(engines, args.setup_repeats)}
    results["compile"] = measure_compiles(engines, args.repeats)
    bias = quote_bias(engines, args.quote_bias)
    warm_up_apply(engines)
    results["copy_bandwidth_gb_s"] = round(measure_bandwidth(seconds=0.3, megabytes=128) / 1e9, 1)
    names = list(SCHEMAS)
    plan = [(mixed_rows(names, b), True) for b in args.batch_sizes]
    plan += [([name] * max(args.batch_sizes), False) for name in args.same_schema]
    results["steps"] = [run_batch(engines, rows, args.steps, args.seed + k, bias, mixed)
                        for k, (rows, mixed) in enumerate(plan)]  # fmt: skip
    results["xgr_fill"] = None if engines.xgr is None else ("xgr_batch" if engines.xgr_batch else "xgr_loop")
    results["dependencies"] = measure_dependencies(["llguidance", "xgrammar"])
    results["break_even"] = break_even(results["compile"], results["steps"]) if engines.xgr is not None else []
    results["verdict"] = verdict(results)
    results["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    record: dict[str, Any] = {
        "benchmark": "structured_backends", "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "cpu": cpu,
        "config": config, "results": results, "notes": [], "wall_s": None,
    }  # fmt: skip
    record["notes"] = notes(record)
    record["wall_s"] = round(time.perf_counter() - started, 1)
    tables = format_tables(record)
    print()
    print(tables)
    header = (f"# structured_backends ({record['created']})\n\nconfig: "
              + ", ".join(f"{k}={v}" for k, v in config.items()) + f"\n\ncpu: {describe_cpu(cpu)}\n\n")  # fmt: skip
    write_result_files(args.out, record, header + tables)


if __name__ == "__main__":
    main()
