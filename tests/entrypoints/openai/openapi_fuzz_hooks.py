"""Schemathesis hooks for test_openapi_fuzz.py (loaded with SCHEMATHESIS_HOOKS).

One check replaces schemathesis' positive_data_acceptance: the same check, except for
a 400 that names one of the rules a schema cannot state (DOCUMENTED_REFUSALS). Every
response it sees is also logged (method, path, status) to $PAGELLM_FUZZ_LOG, so that
the test can count the requests per operation.
"""

from __future__ import annotations

import json
import os
import re

import schemathesis
from schemathesis.specs.openapi.checks import positive_data_acceptance

# (param, message pattern) of the 400s that a schema-valid body may get: each a rule
# that relates two fields, depends on what text becomes as tokens, or on whether a
# grammar compiles.
DOCUMENTED_REFUSALS = [
    # The prompt's tokens (plus max_tokens) must fit in max_model_len.
    (r"prompt|messages|max_tokens|max_completion_tokens|input|text_2|documents", r"maximum context length|max_model_len"),
    # Two fields together.
    (r"text_2", r"two lists of the same length"),
    (r"expires_after", r"expires_after needs anchor"),  # its two form fields, both or neither
    (r"min_tokens", r"must not exceed max_tokens"),
    (r"max_tokens", r"0 only with echo"),
    (r"best_of", r"'best_of' other than n is not supported"),
    # The sum of a message's text parts (a schema bounds one string's length).
    (r"messages", r"characters of content; at most"),
    # One output constraint per request, and it must compile.
    (r"guided_json|guided_regex|guided_choice|guided_grammar|structured_outputs|response_format",
     r"Give one output constraint|: "),
    (r"tools|tool_choice", r"tool"),
    # The Responses API: a background response is stored and not streamed; a conversation's
    # items must make a valid chat (e.g. an assistant turn with content).
    (r"background", r"must be stored"),
    (r"stream", r"background and stream together"),
    (r"input", r"Invalid input|characters of content; at most"),
    (r"previous_response_id", r"still running"),
    # A LoRA adapter is a folder the server reads: whether one is there, and what it holds.
    (r"lora_path", r"LoRA adapter|adapter_config|safetensors"),
    (r"lora_name", r"already loaded|base model's name|must not be empty"),
]  # fmt: skip


def documented_refusal(status: int, body: object) -> bool:
    if status == 413:  # the body is over --max-request-body-bytes
        return True
    if status != 400 or not isinstance(body, dict):
        return False
    if isinstance(body.get("error"), str):  # Ollama's shape names no field: any documented rule's message
        return any(re.search(pattern, body["error"]) for _, pattern in DOCUMENTED_REFUSALS)
    if not isinstance(body.get("error"), dict):
        return False
    if body.get("type") == "error":  # Anthropic's shape names no field: any documented rule's message
        message = body["error"].get("message") or ""
        return any(re.search(pattern, message) for _, pattern in DOCUMENTED_REFUSALS)
    param = body["error"].get("param") or ""
    message = body["error"].get("message") or ""
    return any(
        re.fullmatch(param_pattern, param) and re.search(message_pattern, message)
        for param_pattern, message_pattern in DOCUMENTED_REFUSALS
    )


def _log(case: object, status: int, documented: bool) -> None:
    path = os.environ.get("PAGELLM_FUZZ_LOG")
    if path:
        with open(path, "a") as log:
            log.write(json.dumps([case.method.upper(), case.path, status, documented]) + "\n")  # type: ignore[attr-defined]


@schemathesis.check
def positive_data_acceptance_but_documented_rules(ctx, response, case):  # noqa: ANN001, ANN201
    try:
        body = json.loads(response.content)
    except ValueError:
        body = None
    documented = documented_refusal(response.status_code, body)
    _log(case, response.status_code, documented)
    if documented:
        return None
    return positive_data_acceptance(ctx, response, case)
