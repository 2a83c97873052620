"""Entrypoints stage: HTTP: splitting a thinking model's output into its reasoning and its answer.

Thinking models write their reasoning between tags before the answer: `<think>...</think>`
(DeepSeek-R1, whose chat template opens the tag in the prompt, so its output starts inside
the reasoning; Qwen3, whose output opens the tag itself, or, with thinking turned off, has
none). The split works on the decoded text, not on token ids, so a tokenizer without a
dedicated think token (the tags then arrive as several tokens) splits the same way.

`split_reasoning` splits a whole output; `StreamingReasoning` splits it delta by delta,
holding back any tail that could be the start of a tag, so that a tag cut across two deltas
never reaches either field, and the streamed pieces add up to the whole split.

Where the output starts depends on the prompt too (`ReasoningSplit.for_prompt`): a template
that opens the think block (DeepSeek-R1's, Qwen3's thinking-only models) starts it inside the
reasoning; one that writes an empty block (Qwen3 with `enable_thinking` off) leaves only the
answer. An output constraint applies to the answer, after the block (`think_block`), unless
the server is told to apply it from the first token.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagellm.structured_outputs_params import ThinkBlock


@dataclass(frozen=True)
class ReasoningFormat:
    """A family's tags, and whether its output starts inside the reasoning."""

    name: str
    start: str = "<think>"
    end: str = "</think>"
    starts_in_reasoning: bool = False


# vLLM's --reasoning-parser names.
REASONING_FORMATS = {
    "deepseek_r1": ReasoningFormat("deepseek_r1", starts_in_reasoning=True),
    "qwen3": ReasoningFormat("qwen3"),
}


# Where an output starts: decided by what it writes first, inside the reasoning, or in the answer.
UNDECIDED, IN_REASONING, IN_CONTENT = "undecided", "reasoning", "content"


@dataclass(frozen=True)
class ReasoningSplit:
    """How one request's output splits: its family's tags, and where the prompt left off."""

    fmt: ReasoningFormat
    start: str = UNDECIDED

    @classmethod
    def for_prompt(cls, fmt: ReasoningFormat, prompt: str) -> ReasoningSplit:
        """A prompt that ends in an open start tag puts the output inside the reasoning; one
        that ends in an end tag (an empty block the template wrote) leaves only the answer.
        Only the prompt's end counts: tags in earlier turns say nothing about this one."""
        tail = prompt.rstrip()
        if tail.endswith(fmt.start):
            return cls(fmt, IN_REASONING)
        if tail.endswith(fmt.end) and tail.rfind(fmt.start) >= 0:
            return cls(fmt, IN_CONTENT)
        return cls(fmt, UNDECIDED)

    def split(self, text: str) -> tuple[str | None, str | None]:
        return split_reasoning(text, self.fmt, self.start)

    def streaming(self) -> StreamingReasoning:
        return StreamingReasoning(self.fmt, self.start)

    def think_block(self) -> ThinkBlock | None:
        """The block an output constraint leaves free (None: the output is all answer)."""
        if self.start == IN_CONTENT:
            return None
        return ThinkBlock(
            self.fmt.start, self.fmt.end, opened=self.start == IN_REASONING, required=self.fmt.starts_in_reasoning
        )


def split_reasoning(text: str, fmt: ReasoningFormat, start: str = UNDECIDED) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole output; None for a part that is absent."""
    parser = StreamingReasoning(fmt, start)
    reasoning, content = parser.feed(text)
    more_reasoning, more_content = parser.finish()
    reasoning += more_reasoning
    content += more_content
    return (reasoning if parser.saw_reasoning else None), (content or None)


def _held_back(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag` (0: none)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class StreamingReasoning:
    """Splits an output as it streams: `feed(delta)` returns the (reasoning, content) text
    that is now certain, `finish()` what was held back."""

    def __init__(self, fmt: ReasoningFormat, start: str = UNDECIDED) -> None:
        self.fmt = fmt
        self.state = start  # undecided: before the output shows whether it opens the start tag
        self.buffer = ""
        self.after_end = False  # just past the end tag: its newlines are not content
        self.saw_reasoning = start == IN_REASONING  # the output had a reasoning part (perhaps empty)

    def feed(self, delta: str) -> tuple[str, str]:
        self.buffer += delta
        reasoning, content = "", ""
        while True:
            if self.state == UNDECIDED:
                head = self.buffer.lstrip()
                if head.startswith(self.fmt.start):
                    self.buffer = head[len(self.fmt.start) :]
                    self._enter(IN_REASONING)
                elif head and not self.fmt.start.startswith(head):
                    self._enter(IN_REASONING if self.fmt.starts_in_reasoning else IN_CONTENT)
                else:
                    return reasoning, content  # nothing yet, or part of the start tag
            if self.state == IN_REASONING:
                index = self.buffer.find(self.fmt.end)
                if index >= 0:
                    reasoning += self.buffer[:index]
                    self.buffer = self.buffer[index + len(self.fmt.end) :]
                    self.after_end = True
                    self._enter(IN_CONTENT)
                    continue
                keep = _held_back(self.buffer, self.fmt.end)
                reasoning += self.buffer[: len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep :]
                return reasoning, content
            # content
            if self.after_end:
                self.buffer = self.buffer.lstrip("\n")
                if not self.buffer:
                    return reasoning, content
                self.after_end = False
            content += self.buffer
            self.buffer = ""
            return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The text held back at the end (a partial tag that never completed is text)."""
        rest, self.buffer = self.buffer, ""
        if self.state == UNDECIDED:
            if not rest.strip():
                return "", ""
            self._enter(IN_REASONING if self.fmt.starts_in_reasoning else IN_CONTENT)
        if self.state == IN_REASONING:
            return rest, ""
        return "", rest

    def _enter(self, state: str) -> None:
        self.state = state
        self.saw_reasoning = self.saw_reasoning or state == IN_REASONING
