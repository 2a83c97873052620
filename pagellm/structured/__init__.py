"""Structured outputs: constraints compiled to grammars (llguidance) and applied as token masks."""
