"""Entrypoints stage: HTTP: Ollama's API's request bodies (/api/chat, /api/generate,
/api/embed, /api/show), as Ollama reads them: unknown fields ignored, as Ollama does.

`options` holds the sampling settings under llama.cpp's names; those that only tune how
Ollama loads a model (num_ctx, num_gpu, num_thread, use_mmap, ...) are accepted and have no
effect here (the server's own flags decide them); a sampler pagellm does not have
(mirostat, tfs_z, typical_p other than their off values) is refused, and so are images,
`suffix` and `template`: the schema says so.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from pagellm.entrypoints.openai.protocol import ToolDefinition


class OllamaModel(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class OllamaError(BaseModel):
    """Every error on /api: the message, with the HTTP status."""

    error: str


class OllamaOptions(OllamaModel):
    # Ollama's defaults where a request leaves them out (llama.cpp's sampler defaults).
    temperature: float = Field(0.8, ge=0)
    top_p: float = Field(0.9, gt=0, le=1)
    top_k: int = Field(40, ge=0)
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = None
    num_predict: int = Field(-1, ge=-2)  # -1: until the end; -2: fill the context
    stop: list[str] | None = None
    repeat_penalty: float | None = Field(None, gt=0)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Samplers pagellm does not have: accepted at their off values only (the schema says so).
    mirostat: Literal[0] = 0
    tfs_z: Literal[1] = 1
    typical_p: Literal[1] = 1


class OllamaToolCallFunction(OllamaModel):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class OllamaToolCall(OllamaModel):
    function: OllamaToolCallFunction


class OllamaMessage(OllamaModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = Field(None, max_length=0)  # no image input here: none or []
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None  # a tool result's function


class OllamaChatRequest(OllamaModel):
    model: str = Field(min_length=1)
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[ToolDefinition] | None = None
    format: Literal["json"] | dict[str, Any] | None = None
    options: OllamaOptions = Field(default_factory=OllamaOptions)
    stream: bool = True
    keep_alive: str | int | None = None  # the model stays loaded for the server's life
    think: bool | str | None = None


class OllamaGenerateRequest(OllamaModel):
    model: str = Field(min_length=1)
    prompt: str = ""
    suffix: str | None = Field(None, max_length=0)  # no fill-in-the-middle here
    system: str | None = None
    template: str | None = Field(None, max_length=0)  # the model's own template (or raw) only
    context: list[Annotated[int, Field(ge=0)]] | None = None  # the token ids an earlier answer returned: continued
    raw: bool = False  # the prompt as it is, no chat template
    images: list[str] | None = Field(None, max_length=0)
    format: Literal["json"] | dict[str, Any] | None = None
    options: OllamaOptions = Field(default_factory=OllamaOptions)
    stream: bool = True
    keep_alive: str | int | None = None
    think: bool | str | None = None


class OllamaEmbedRequest(OllamaModel):
    model: str = Field(min_length=1)
    input: Annotated[str, Field(min_length=1)] | list[Annotated[str, Field(min_length=1)]]
    truncate: bool = True
    dimensions: int | None = Field(None, ge=1)
    options: OllamaOptions = Field(default_factory=OllamaOptions)
    keep_alive: str | int | None = None


class OllamaShowRequest(OllamaModel):
    model: str = Field(min_length=1, validation_alias=AliasChoices("model", "name"))  # `name`: older clients' spelling
    verbose: bool = False
