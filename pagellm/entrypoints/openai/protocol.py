"""Entrypoints stage: HTTP: the OpenAI-compatible request and response bodies, as pydantic models.

The request models are the contract /openapi.json publishes, and the one place a body's
types and value ranges are checked: strictly (no "1" for 1 or "true" for true), with the
same ranges SamplingParams enforces for the offline API (sampling_ranges), finite floats
and integers a JSON number carries exactly. What depends on the served model or the server's flags
(vocabulary size, max_model_len, request limits) is added to the published schema at
start (openapi_docs.py) and checked by request_limits.py and the serving code. Unknown
fields are ignored, as the OpenAI API does. The extra sampling fields vLLM accepts
(top_k, min_p, repetition_penalty, ...) are accepted under the same names.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, model_validator

from pagellm.entrypoints.openai.limits_config import MAX_N
from pagellm.sampling_params import MAX_LOGIT_BIAS, PENALTY_RANGE, REPETITION_PENALTY_MAX, REPETITION_PENALTY_MIN

MAX_LOGPROBS = 20  # alternatives per position
# Integers a JSON number carries exactly in every client (JavaScript's safe integers):
# seeds and priorities beyond them would not mean what the client wrote.
MAX_SAFE_INT = 2**53 - 1
# A token id written as a JSON object key (logit_bias): digits, no sign, no leading zero.
TOKEN_ID_KEY_PATTERN = r"^(0|[1-9][0-9]*)$"


class OpenAIModel(BaseModel):
    # allow_inf_nan=False: JSON bodies may carry NaN/Infinity literals, which no sampling
    # parameter can mean.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class RequestModel(OpenAIModel):
    """A request body's part: strict types, so that what the schema calls invalid is."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


def _integral_float_as_int(value: Any) -> Any:
    # JSON Schema counts 98.0 as an integer, and so does the server; 98.5 and "98" stay
    # invalid (the models are strict).
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


_INTEGRAL = BeforeValidator(_integral_float_as_int)


def _int(**bounds: int) -> Any:
    # Bounds before the validator: so they appear in the JSON schema as minimum/maximum.
    return Annotated[int, Field(**bounds), _INTEGRAL]


NonNegativeInt = _int(ge=0)
PositiveInt = _int(ge=1)
TokenId = NonNegativeInt
NumCompletions = _int(ge=1, le=MAX_N)
NumLogprobs = _int(ge=0, le=MAX_LOGPROBS)
TopK = _int(ge=-1)
TokenIdKey = Annotated[str, Field(pattern=TOKEN_ID_KEY_PATTERN)]
LogitBias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]
StopString = Annotated[str, Field(min_length=1)]
SafeInt = _int(ge=-MAX_SAFE_INT, le=MAX_SAFE_INT)
Penalty = Annotated[float, Field(ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])]

# ------------------------------------------------------------------------ requests


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk, counted so far


class JsonSchemaFormat(RequestModel):
    name: str | None = None
    description: str | None = None
    # "schema" shadows a BaseModel attribute: the field is named schema_ in Python.
    schema_: dict[str, Any] | bool = Field(alias="schema")
    strict: bool | None = None


class TextResponseFormat(RequestModel):
    type: Literal["text"]


class JsonObjectResponseFormat(RequestModel):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(RequestModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


# OpenAI's response_format: text, any JSON object, or JSON following a schema.
ResponseFormat = Annotated[
    TextResponseFormat | JsonObjectResponseFormat | JsonSchemaResponseFormat, Field(discriminator="type")
]


class StructuredOutputsFields(RequestModel):
    """vLLM's structured_outputs field (one of these)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    # An empty regex or grammar constrains to nothing: refused, as the schema says.
    regex: str | None = Field(None, min_length=1)
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = Field(None, min_length=1)


class SamplingFields(RequestModel):
    """Fields shared by completions and chat: the model and how to sample."""

    model: str | None = None
    n: NumCompletions = 1
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: SafeInt | None = None
    stop: StopString | list[StopString] | None = None
    logit_bias: dict[TokenIdKey, LogitBias] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extra sampling fields.
    top_k: TopK | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, ge=REPETITION_PENALTY_MIN, le=REPETITION_PENALTY_MAX)
    min_tokens: NonNegativeInt | None = None
    ignore_eos: bool = False
    priority: SafeInt = 0
    # pagellm's: the answer carries `timings` (llama.cpp's names: queue, prefill and decode
    # time, cached tokens by source, preemptions, speculation), as --enable-per-request-metrics does.
    timings: bool = False
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Output constraints: OpenAI's response_format, vLLM's structured_outputs and its
    # older guided_* fields (one of them per request).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsFields | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None


# One prompt or several, each text or token ids; no empty list. (Whether a text prompt
# has tokens depends on the tokenizer: "" with a BOS token is one.)
Prompt = (
    str
    | Annotated[list[str], Field(min_length=1)]
    | Annotated[list[TokenId], Field(min_length=1)]
    | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
)


class CompletionRequest(SamplingFields):
    prompt: Prompt
    # 0 only with echo: the prompt (and its logprobs) alone, for scoring.
    max_tokens: NonNegativeInt | None = 16
    echo: bool = False
    logprobs: NumLogprobs | None = None
    best_of: NumCompletions | None = None  # only equal to n
    suffix: None = Field(None, description="Not supported: only null.")


# What to embed: one text or several, or token ids (one list, or a list of them); no
# empty text (it has no tokens to pool) and no empty list.
EmbeddingInput = (
    Annotated[str, Field(min_length=1)]
    | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
    | Annotated[list[TokenId], Field(min_length=1)]
    | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
)


class EmbeddingRequest(RequestModel):
    model: str | None = None
    input: EmbeddingInput
    # float: JSON numbers; base64: each embedding's little-endian float32 bytes.
    encoding_format: Literal["float", "base64"] = "float"
    # Keep the first `dimensions` values (models trained for Matryoshka embeddings only).
    dimensions: PositiveInt | None = None
    user: str | None = None
    # vLLM's extras: whether to L2-normalise (default true), the scheduling priority.
    normalize: bool | None = None
    priority: SafeInt = 0


class TextContentPart(RequestModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)
    type: Literal["text"]
    text: str


Role = Literal["system", "developer", "user", "assistant", "tool"]


class ChatMessage(RequestModel):
    # Templates may read more keys (name, tool_call_id, ...): keep them.
    model_config = ConfigDict(
        extra="allow",
        allow_inf_nan=False,
        strict=True,
        # What the validator below checks, for the published schema.
        json_schema_extra={
            "anyOf": [
                {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
                {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array", "minItems": 1}}},
            ]
        },
    )
    role: Role
    content: str | list[TextContentPart] | None = None
    # An assistant turn calling tools (OpenAI's shape; the template reads it).
    tool_calls: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _content_or_tool_calls(self) -> ChatMessage:
        if self.content is None and not self.tool_calls:
            raise ValueError("a message needs content (null only beside a non-empty tool_calls)")
        return self


class FunctionDefinition(RequestModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class ToolDefinition(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class PromptCacheOptions(RequestModel):
    comparison_id: str | None = Field(None, min_length=1)  # an earlier answer's id (chat)
    comparison_response_id: str | None = Field(None, min_length=1)  # the Responses API's name for it

    @property
    def compare_with(self) -> str | None:
        return self.comparison_id or self.comparison_response_id


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    # Passed to the chat template (e.g. Qwen3's enable_thinking).
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: whether the prompt opens the assistant's turn (by default it does, unless the
    # last message is continued), and whether the last message (an assistant's prefill) is
    # left open for the model to continue.
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    # pagellm's, as the Responses API's: diagnose this prompt's cache hits against an earlier
    # chat completion's (its id); the answer carries prompt_cache_diagnostics.
    prompt_cache_options: PromptCacheOptions | None = None
    # OpenAI's: how hard a reasoning model thinks (gpt-oss: the harmony system message's
    # "Reasoning:" line; "minimal" is its low). Other models ignore it, as OpenAI's do.
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None


class TokenizeFields(RequestModel):
    model: str | None = None


class TokenizeCompletionRequest(TokenizeFields):
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(TokenizeFields):
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool | None = None  # as in a chat request
    continue_final_message: bool = False


def _tokenize_form(body: Any) -> str | None:
    # Exactly one of prompt and messages (a null one counts as absent): the published
    # schema says the same with oneOf.
    keys = {key for key, value in body.items() if value is not None} if isinstance(body, dict) else set()
    if "prompt" in keys and "messages" not in keys:
        return "prompt"
    if "messages" in keys and "prompt" not in keys:
        return "messages"
    return None


# The form is chosen by the key present, so that errors name the field they are about.
TokenizeRequest = Annotated[
    Annotated[TokenizeCompletionRequest, Tag("prompt")] | Annotated[TokenizeChatRequest, Tag("messages")],
    Discriminator(
        _tokenize_form,
        custom_error_type="tokenize_form",
        custom_error_message="Give exactly one of 'prompt' and 'messages'.",
    ),
]


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[TokenId]


# ----------------------------------------------------------------------- responses


def unix_time() -> int:
    return int(time.time())


class PromptTokensDetails(OpenAIModel):
    cached_tokens: int = 0  # served from the prefix cache (either tier) rather than computed


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class EmbeddingData(OpenAIModel):
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # str: base64 of little-endian float32
    index: int


class EmbeddingUsage(OpenAIModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingResponse(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class CompletionLogprobs(OpenAIModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(OpenAIModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=unix_time)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIModel):
    content: list[ChatLogprobToken] | None = None


class FunctionCall(OpenAIModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(OpenAIModel):
    role: str = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None
    # With --reasoning-parser: the text between the think tags (absent otherwise).
    reasoning_content: str | None = Field(None, exclude_if=lambda value: value is None)


class ChatChoice(OpenAIModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=unix_time)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ChatChunkChoice(OpenAIModel):
    index: int
    # {"role": "assistant"} first, then {"content": "..."}; only the keys that are sent.
    delta: dict[str, Any]
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(OpenAIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=unix_time)
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=unix_time)
    owned_by: str = "pagellm"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class LoadLoRAAdapterRequest(RequestModel):
    """POST /v1/load_lora_adapter (vLLM's body)."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(RequestModel):
    """POST /v1/unload_lora_adapter (vLLM's body; lora_int_id is accepted and not needed)."""

    lora_name: str
    lora_int_id: int | None = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(OpenAIModel):
    prompt: str


class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(OpenAIModel):
    error: ErrorInfo
