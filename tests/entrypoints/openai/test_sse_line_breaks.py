"""Streamed events never contain a character that line readers split at: a token that
decodes to U+2028, U+2029 or U+0085 travels escaped, and the load generator splits
event streams only where SSE does."""

import asyncio
import json

from pagellm.bench.serve_load import sse_lines
from pagellm.entrypoints.openai.streaming import sse_event


def test_line_separators_inside_json_strings_are_escaped():
    payload = {"text": "a\u2028b\u2029c\x85d", "n": 1}
    event = sse_event(json.dumps(payload, ensure_ascii=False))
    assert event.endswith("\n\n") and event.count("\n") == 2
    assert event.splitlines() == [event[:-2], ""]  # Python's own line splitting sees one event line
    assert json.loads(event[len("data: ") :]) == payload


def test_sse_lines_split_only_at_sse_line_ends():
    async def chunks():
        for piece in ['data: {"t": "x\u2028', 'y"}\r', '\ndata: [DONE]\n', "\n", "tail"]:
            yield piece

    async def collect():
        return [line async for line in sse_lines(chunks())]

    lines = asyncio.run(collect())
    assert [line for line in lines if line] == ['data: {"t": "x\u2028y"}', "data: [DONE]", "tail"]
