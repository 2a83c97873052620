"""Tokenizer stage: text that is not valid Unicode, found and named.

A Python str can hold a lone UTF-16 surrogate (JSON's `"\\ud800"` decodes to one; a
JavaScript client that cuts a string inside an emoji sends it). No tokenizer can encode
it, nor can any UTF-8 output: it is refused as bad input, with where it is.
"""

from __future__ import annotations


def lone_surrogate(text: str) -> int | None:
    """The index of the first lone surrogate in `text`, or None when it is valid Unicode."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as error:
        return error.start


def surrogate_message(where: str, text: str, index: int) -> str:
    """What is wrong with `text` (named `where`), without echoing the surrogate itself."""
    return (
        f"{where} is not valid Unicode: a lone UTF-16 surrogate (U+{ord(text[index]):04X}) at character {index}; "
        "a surrogate must be half of a pair (a string cut inside an emoji leaves one alone)"
    )
