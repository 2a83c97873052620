"""Entrypoints stage: harmony's special tokens, by name (one token each in gpt-oss's vocabulary)."""

from __future__ import annotations

START = "<|start|>"  # opens a message: the role (and header) follow
END = "<|end|>"  # closes a message the conversation goes on after
MESSAGE = "<|message|>"  # ends the header, begins the content
CHANNEL = "<|channel|>"  # the channel's name follows: analysis, commentary or final
CONSTRAIN = "<|constrain|>"  # the content's format follows (json for tool calls)
RETURN = "<|return|>"  # ends the model's final answer (generation stops)
CALL = "<|call|>"  # ends a tool call (generation stops; the tool's result comes next)

ALL = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
# What ends the model's turn: generation stops at either.
STOPS = (RETURN, CALL)
