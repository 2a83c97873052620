"""Structured stage: constraints compiled to grammars (llguidance) and applied as token masks."""
