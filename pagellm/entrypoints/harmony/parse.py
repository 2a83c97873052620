"""Entrypoints stage: a harmony output as reasoning, answer and tool calls, whole or as it streams.

gpt-oss writes its turn as messages, each a header and a content:

    <|channel|>analysis<|message|>...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>...<|return|>

(the prompt ends in `<|start|>assistant`, so the first message's header starts right after
it). The analysis channel is the reasoning; the final channel is the answer; a message
addressed to a function (`to=functions.NAME`, in the header before or after the channel)
is a tool call whose content is its JSON arguments; any other commentary is a preamble
shown as text. The parser reads the decoded text with the special tokens kept, one delta
at a time, and never lets a special token reach a field: a delta that ends in the first
characters of one holds them back until the next.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from pagellm.entrypoints.harmony import tokens

ANALYSIS, COMMENTARY, FINAL = "analysis", "commentary", "final"
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


@dataclass
class HarmonyCall:
    """A tool call: the function's name and its arguments' text as far as it came."""

    name: str
    arguments: str = ""


@dataclass
class HarmonyDelta:
    """What one piece of output added: reasoning, answer text, and tool calls (an index
    into `calls` with the arguments text added; a new call arrives with its name)."""

    reasoning: str = ""
    content: str = ""
    calls: list[tuple[int, str | None, str]] = field(default_factory=list)  # (index, name when new, arguments)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


@dataclass
class HarmonyOutput:
    """A whole output, parsed."""

    reasoning: str | None
    content: str | None
    calls: list[HarmonyCall]


class HarmonyParser:
    """Parses an output as it streams: feed(delta) -> HarmonyDelta; finish() the rest."""

    def __init__(self, open_channel: str | None = None) -> None:
        """open_channel: the prompt left a message of this channel open (a continued final
        answer), so the output starts in its content; else with a header."""
        self.buffer = ""
        self.in_header = open_channel is None
        self.channel: str | None = open_channel
        self.call_index: int | None = None  # the message being read is this tool call
        self.calls: list[HarmonyCall] = []
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.saw_reasoning = False

    def feed(self, text: str) -> HarmonyDelta:
        self.buffer += text
        delta = HarmonyDelta()
        while self.buffer:
            if self.in_header:
                index = self.buffer.find(tokens.MESSAGE)
                if index < 0:  # the header is not complete yet
                    return delta
                self._open(self.buffer[:index])
                self.buffer = self.buffer[index + len(tokens.MESSAGE) :]
                if self.call_index is not None:
                    delta.calls.append((self.call_index, self.calls[self.call_index].name, ""))
                continue
            ends = [(self.buffer.find(t), t) for t in (tokens.END, tokens.CALL, tokens.RETURN, tokens.START)]
            found = [(index, token) for index, token in ends if index >= 0]
            if found:
                index, token = min(found)
                self._add(delta, self.buffer[:index])
                self.buffer = self.buffer[index + len(token) :]
                self._close()
                if token == tokens.START:  # a message that began without closing the last
                    self.buffer = tokens.START + self.buffer
                continue
            keep = _held_back(self.buffer)
            self._add(delta, self.buffer[: len(self.buffer) - keep])
            self.buffer = self.buffer[len(self.buffer) - keep :]
            return delta
        return delta

    def finish(self) -> HarmonyDelta:
        """What was held back (text cut off mid-message is that message's)."""
        delta = HarmonyDelta()
        if not self.in_header:
            self._add(delta, self.buffer)
        self.buffer = ""
        return delta

    def output(self) -> HarmonyOutput:
        return HarmonyOutput(
            "".join(self.reasoning) if self.saw_reasoning else None, "".join(self.content) or None, self.calls
        )

    def _open(self, header: str) -> None:
        """A message's header: [<|start|>role] [to=recipient] <|channel|>name [<|constrain|>format]."""
        header = header.replace(tokens.START, " ")
        channel = _CHANNEL.search(header)
        self.channel = channel.group(1) if channel else None
        recipient = _RECIPIENT.search(header)
        self.call_index = None
        if recipient is not None and recipient.group(1) != "assistant":
            name = recipient.group(1).removeprefix("functions.")
            self.calls.append(HarmonyCall(name))
            self.call_index = len(self.calls) - 1
        elif self.channel == ANALYSIS:
            self.saw_reasoning = True
        self.in_header = False

    def _close(self) -> None:
        self.in_header, self.channel, self.call_index = True, None, None

    def _add(self, delta: HarmonyDelta, text: str) -> None:
        if not text:
            return
        if self.call_index is not None:
            self.calls[self.call_index].arguments += text
            delta.calls.append((self.call_index, None, text))
        elif self.channel == ANALYSIS:
            self.reasoning.append(text)
            delta.reasoning += text
        else:  # the final answer, or a preamble on the commentary channel
            self.content.append(text)
            delta.content += text


def parse_harmony(text: str, open_channel: str | None = None) -> HarmonyOutput:
    """A whole output's reasoning (None: no analysis), answer (None: none) and tool calls."""
    parser = HarmonyParser(open_channel)
    parser.feed(text)
    parser.finish()
    return parser.output()


def _held_back(text: str) -> int:
    """How many characters at the end of `text` could begin a special token."""
    for size in range(min(len(text), max(len(t) for t in tokens.ALL) - 1), 0, -1):
        if any(t.startswith(text[-size:]) for t in tokens.ALL):
            return size
    return 0
