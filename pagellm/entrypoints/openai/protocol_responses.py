"""Entrypoints stage: HTTP: the Responses API's request and response bodies (POST /v1/responses).

The request's input is a text or a list of items: messages (with text parts), earlier
function calls and their outputs; tools are functions; `text.format` asks for JSON (a
schema, or any object). These are checked as strictly as the chat request's fields are
(protocol.py) and translated into a chat request (serving_responses.py), which is what
runs underneath.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from pagellm.entrypoints.openai.protocol import (
    OpenAIModel,
    PositiveInt,
    PromptCacheOptions,
    RequestModel,
    SafeInt,
    StructuredOutputsFields,
)


class InputTextPart(RequestModel):
    # input_text in user turns, output_text in the assistant's earlier answers.
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(RequestModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | Annotated[list[InputTextPart], Field(min_length=1)]


class FunctionCallItem(RequestModel):
    """A call the model made earlier (sent back with its output)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(RequestModel):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str


class ReasoningItem(RequestModel):
    """An earlier answer's reasoning, sent back: not shown to the model again."""

    type: Literal["reasoning"]


def _item_kind(item: Any) -> str | None:
    if isinstance(item, dict):
        return item.get("type", "message")
    return getattr(item, "type", None)


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(
        _item_kind,
        custom_error_type="input_item",
        custom_error_message="An input item is a message (role and content), a function_call or a function_call_output.",
    ),
]


class FunctionTool(RequestModel):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(RequestModel):
    type: Literal["function"]
    name: str


class TextFormatText(RequestModel):
    type: Literal["text"]


class TextFormatJsonObject(RequestModel):
    type: Literal["json_object"]


class TextFormatJsonSchema(RequestModel):
    type: Literal["json_schema"]
    name: str = Field(min_length=1, max_length=64)
    # "schema" shadows a BaseModel attribute: the field is named schema_ in Python.
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(RequestModel):
    format: Annotated[TextFormatText | TextFormatJsonObject | TextFormatJsonSchema, Field(discriminator="type")] | None = None


class ReasoningConfig(RequestModel):
    """How hard a reasoning model thinks (gpt-oss: harmony's "Reasoning:" line) and whether
    it summarises its reasoning (accepted; the reasoning items carry the text itself)."""

    effort: Literal["minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(RequestModel):
    model: str | None = None
    input: Annotated[str, Field(min_length=1)] | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    # Kept (in this server's memory, the oldest evicted first) for GET and previous_response_id.
    store: bool = True
    # Run after the answer: the POST returns at once (status queued), GET polls, cancel stops it.
    background: bool = False
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    seed: SafeInt | None = None
    priority: SafeInt = 0
    timings: bool = False  # pagellm's, as on the chat endpoint: the response carries `timings`
    prompt_cache_options: PromptCacheOptions | None = None  # comparison_response_id: prompt_cache_diagnostics
    # vLLM's extension (as on the chat endpoint): an output constraint (json, regex, choice, grammar).
    structured_outputs: StructuredOutputsFields | None = None


class ResponseUsage(OpenAIModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens_details: dict[str, int]


class ResponseObject(OpenAIModel):
    """A response as created, stored and returned (its output items in OpenAI's shapes:
    `message` with `output_text` parts, `function_call`)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["queued", "in_progress", "completed", "incomplete", "cancelled", "failed"]
    model: str
    output: list[dict[str, Any]]
    usage: ResponseUsage | None = None
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    previous_response_id: str | None = None
    store: bool = True
    background: bool = False
    metadata: dict[str, str] = Field(default_factory=dict)
    truncation: str = "disabled"
    user: str | None = None


class DeletedResponse(OpenAIModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True
