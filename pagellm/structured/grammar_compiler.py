"""Structured stage: compile a request's constraint into a grammar matcher, once per
distinct constraint.

The grammar engine is llguidance (the Rust library llama.cpp also uses), chosen by
measurement (benchmarks/structured_backends.py, results/structured_backends.md): it
compiles 2-57x faster than xgrammar (0.3-2.3 ms for real schemas, regexes and GBNF
against 0.6-48 ms), which is what a request with a new schema waits for. xgrammar fills
a batch's masks faster (0.2 against 0.5 ms at 32 rows, a few percent of a decode step
there). llguidance needs no other package (xgrammar brings transformers, triton and
more), and its masks are stricter (canonical tokenizations only). A compiled constraint is kept as a
fresh matcher; each request gets a deep copy of it.

Thread-safe: the server compiles on a worker thread before a request is queued, so a
new schema never stalls the engine's step loop; the engine thread then finds it cached.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from pagellm.errors import InvalidRequestError
from pagellm.structured_outputs_params import HarmonyAnswer, StructuredOutputsParams, ThinkBlock
from pagellm.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 1024


@dataclass(frozen=True)
class CompiledGrammar:
    template: Any  # llguidance.LLMatcher that has consumed nothing
    compile_seconds: float

    def new_matcher(self) -> Any:
        return self.template.deep_copy()


@dataclass
class GrammarStats:
    """Counters for /metrics (the engine takes what is new after each step)."""

    compiles: int = 0
    cache_hits: int = 0
    compile_seconds: list[float] = field(default_factory=list)  # not yet taken
    cache_hits_taken: int = 0

    def take(self) -> tuple[list[float], int]:
        """Compile times and cache hits since the last take."""
        seconds, self.compile_seconds = self.compile_seconds, []
        hits, self.cache_hits_taken = self.cache_hits - self.cache_hits_taken, self.cache_hits
        return seconds, hits


class GrammarCompiler:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()  # building it must not hold up cache hits
        self._ll_tokenizer: Any = None
        self._cache: OrderedDict[tuple[str, str, ThinkBlock | HarmonyAnswer | None], CompiledGrammar] = OrderedDict()
        self._in_progress: dict[tuple[str, str, ThinkBlock | HarmonyAnswer | None], threading.Event] = {}
        self.stats = GrammarStats()

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled constraint (from the cache when seen before). A constraint the
        engine cannot compile is an InvalidRequestError naming its kind."""
        key = params.key
        while True:
            with self._lock:
                cached = self._cache.get(key)
                if cached is not None:
                    self._cache.move_to_end(key)
                    self.stats.cache_hits += 1
                    return cached
                pending = self._in_progress.get(key)
                if pending is None:
                    self._in_progress[key] = threading.Event()
                    break
            pending.wait()  # another thread compiles the same constraint: use its result
            with self._lock:
                if key not in self._cache and key not in self._in_progress:
                    break  # it failed there; compile here to raise the same error
        try:
            compiled = self._compile(params)
        finally:
            with self._lock:
                self._in_progress.pop(key).set()
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
            self.stats.compiles += 1
            self.stats.compile_seconds.append(compiled.compile_seconds)
        return compiled

    def take_stats(self) -> tuple[list[float], int]:
        with self._lock:
            return self.stats.take()

    def ll_tokenizer(self) -> Any:
        """llguidance's view of the vocabulary (built once: ~0.3 s for 49k tokens)."""
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                import llguidance

                self._ll_tokenizer = llguidance.LLTokenizer(
                    self._tokenizer.backend.to_str(),
                    n_vocab=self._vocab_size,
                    eos_token=sorted(self._tokenizer.eos_token_ids),
                )
            return self._ll_tokenizer

    def _compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        import llguidance

        tokenizer = self.ll_tokenizer()
        kind, text = params.kind, params.text
        start = time.perf_counter()
        try:
            if kind == "json_object":
                grammar = llguidance.grammar_from("json_schema", '{"type": "object"}')
            elif kind == "json":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    text, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
                )
            else:
                grammar = llguidance.grammar_from(kind, text)  # regex, choice, grammar (GBNF or Lark)
        except ValueError as e:
            raise InvalidRequestError(f"invalid {kind}: {e}", kind) from None
        if isinstance(params.after_think, HarmonyAnswer):
            grammar = harmony_answer(grammar, params.after_think)
        elif params.after_think is not None:
            grammar = after_think_block(grammar, params.after_think)
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"invalid {kind}: {matcher.get_error()}", kind)
        seconds = time.perf_counter() - start
        logger.debug("compiled a %s constraint in %.1f ms", kind, seconds * 1e3)
        return CompiledGrammar(matcher, seconds)


def _named_answer(answer: str) -> list[dict[str, Any]]:
    """`answer` (an llguidance grammar: a JSON grammar list or Lark text) as sub-grammars, the
    first named "answer"."""
    if answer.lstrip().startswith("{"):
        grammars = json.loads(answer)["grammars"]
    else:
        grammars = [{"lark_grammar": answer}]
    grammars[0] = {**grammars[0], "name": "answer"}
    return grammars


def harmony_answer(answer: str, block: HarmonyAnswer) -> str:
    """An llguidance grammar for a harmony output (gpt-oss): any analysis messages, free,
    then the answer's header (the final channel, or a JSON call to one of the recipients)
    and `answer` as its content. Harmony's markers are special tokens (`<|channel|>` in
    Lark names the token, never text); the model ends the message with <|return|> or
    <|call|>, the end of the turn."""
    if block.recipients:
        names = " | ".join(json.dumps(f"commentary to=functions.{name} ") for name in block.recipients)
        header = f"header: <|channel|> ({names}) <|constrain|> \"json\" <|message|>"
    else:
        header = f"header: <|channel|> {json.dumps(block.channel)} <|message|>"
    wrapper = "\n".join([
        "%llguidance {}",
        "start: analysis* header answer",
        'analysis: <|channel|> "analysis" <|message|> TEXT <|end|> <|start|> "assistant"',
        "TEXT: /(.|\\n)*/",
        header,
        "answer: @answer",
    ])  # fmt: skip
    return json.dumps({"grammars": [{"lark_grammar": wrapper}, *_named_answer(answer)]})


def after_think_block(answer: str, block: ThinkBlock) -> str:
    """An llguidance grammar that leaves a think block free and holds the text after it
    (past the newlines that follow the end tag) to `answer`, an llguidance grammar.

    The block's text is one lazy lexeme: it ends at the first end tag. `answer` becomes a
    named sub-grammar, whatever form the grammar engine wrote it in (a JSON grammar list, or
    Lark text)."""
    grammars = _named_answer(answer)
    start, end = json.dumps(block.start), json.dumps(block.end)
    if block.opened:
        top = "start: reasoning answer"
    elif block.required:
        top = "start: think_open? reasoning answer"
    else:
        top = "start: (think_open reasoning)? answer"
    wrapper = "\n".join([
        "%llguidance {}",
        top,
        f"think_open: /[ \\t\\r\\n]*/ {start}",
        "reasoning: reasoning_text NEWLINES?",
        f"reasoning_text[lazy]: REASONING_TEXT {end}",
        "NEWLINES: /\\n+/",
        "REASONING_TEXT: /(.|\\n)*/",
        "answer: @answer",
    ])  # fmt: skip
    return json.dumps({"grammars": [{"lark_grammar": wrapper}, *grammars]})
