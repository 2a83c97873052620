"""Entrypoints stage: HTTP: the Messages API's request bodies, as Anthropic defines them.

Content is a text or a list of blocks: `text`, `tool_use` (an assistant's call), `tool_result`
(the user's answer to one), and `thinking` / `redacted_thinking` (an earlier answer's
reasoning, accepted and not shown to the model again). Checked as strictly as the OpenAI
bodies are (protocol.py's RequestModel).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from pagellm.entrypoints.openai.protocol import OpenAIModel, PositiveInt, RequestModel, StructuredOutputsFields, TopK


class TextBlock(RequestModel):
    type: Literal["text"]
    text: str


class ToolUseBlock(RequestModel):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(RequestModel):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock] = ""
    is_error: bool = False


class ThinkingBlock(RequestModel):
    type: Literal["thinking", "redacted_thinking"]


def _block_kind(block: Any) -> str | None:
    kind = block.get("type") if isinstance(block, dict) else getattr(block, "type", None)
    return "thinking" if kind == "redacted_thinking" else kind


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[ThinkingBlock, Tag("thinking")],
    Discriminator(
        _block_kind,
        custom_error_type="content_block",
        custom_error_message="A content block is text, tool_use, tool_result or thinking (images are not supported).",
    ),
]


class Message(RequestModel):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[ContentBlock], Field(min_length=1)]


class Tool(RequestModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-]+$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None


class ToolChoiceMode(RequestModel):
    type: Literal["auto", "any", "none"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(RequestModel):
    """A named tool: the schema says the name is needed (a null one is refused by it)."""

    type: Literal["tool"]
    name: str = Field(min_length=1)
    disable_parallel_tool_use: bool = False


def _tool_choice_kind(choice: Any) -> str | None:
    kind = choice.get("type") if isinstance(choice, dict) else getattr(choice, "type", None)
    return "tool" if kind == "tool" else "mode"


ToolChoice = Annotated[
    Annotated[ToolChoiceMode, Tag("mode")] | Annotated[ToolChoiceTool, Tag("tool")],
    Discriminator(_tool_choice_kind),
]


class Metadata(RequestModel):
    user_id: str | None = None


class CountTokensRequest(RequestModel):
    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | Annotated[list[TextBlock], Field(min_length=1)] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None


class JsonOutputFormat(RequestModel):
    """Structured outputs: the answer is JSON that the schema accepts."""

    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(RequestModel):
    format: JsonOutputFormat | None = None
    # A hint to reasoning models of how hard to think; this server has no such knob, and
    # refuses it rather than ignore it: only null is valid, as the schema says.
    effort: None = None


class DiagnosticsRequest(RequestModel):
    previous_message_id: str | None = Field(None, min_length=1)  # null: opted in, nothing to compare yet


class MessagesRequest(CountTokensRequest):
    max_tokens: PositiveInt
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: TopK | None = None
    stream: bool = False
    metadata: Metadata | None = None
    # vLLM's extension (as on the chat endpoint): an output constraint (json, regex, choice, grammar).
    structured_outputs: StructuredOutputsFields | None = None
    # Anthropic's structured outputs: output_config.format (the current SDKs' messages.parse),
    # and output_format, the same under its beta name.
    output_config: OutputConfig | None = None
    output_format: JsonOutputFormat | None = None
    timings: bool = False  # pagellm's, as on the chat endpoint: the answer carries `timings`
    diagnostics: DiagnosticsRequest | None = None  # previous_message_id: the answer's cache diagnostics


class Usage(OpenAIModel):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class MessageResponse(OpenAIModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None = None
    usage: Usage


class CountTokensResponse(OpenAIModel):
    input_tokens: int


class AnthropicErrorDetail(OpenAIModel):
    type: str
    message: str


class AnthropicError(OpenAIModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorDetail
