"""Entrypoints stage: HTTP: Ollama's API's request bodies (/api/chat, /api/generate,
/api/embed, /api/show), as Ollama reads them: unknown fields ignored, as Ollama does.

`options` holds the sampling settings under llama.cpp's names; those that only tune how
Ollama loads a model (num_ctx, num_gpu, num_thread, use_mmap, ...) are accepted and have no
effect here (the server's own flags decide them); a sampler pagellm does not have
(mirostat, tfs_z, typical_p other than their off values) is refused.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class OllamaModel(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class Options(OllamaModel):
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
    # Samplers pagellm does not have: accepted at their off values only.
    mirostat: int = 0
    tfs_z: float = 1.0
    typical_p: float = 1.0


class ToolCallFunction(OllamaModel):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class ToolCall(OllamaModel):
    function: ToolCallFunction


class Message(OllamaModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None  # a tool result's function


class ChatRequest(OllamaModel):
    model: str
    messages: list[Message] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    format: Literal["json"] | dict[str, Any] | None = None
    options: Options = Field(default_factory=Options)
    stream: bool = True
    keep_alive: str | int | None = None  # the model stays loaded for the server's life
    think: bool | str | None = None


class GenerateRequest(OllamaModel):
    model: str
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None  # the token ids an earlier answer returned: continued
    raw: bool = False  # the prompt as it is, no chat template
    images: list[str] | None = None
    format: Literal["json"] | dict[str, Any] | None = None
    options: Options = Field(default_factory=Options)
    stream: bool = True
    keep_alive: str | int | None = None
    think: bool | str | None = None


class EmbedRequest(OllamaModel):
    model: str
    input: str | list[str]
    truncate: bool = True
    dimensions: int | None = Field(None, ge=1)
    options: Options = Field(default_factory=Options)
    keep_alive: str | int | None = None


class ShowRequest(OllamaModel):
    model: str | None = None
    name: str | None = None  # older clients' spelling of model
    verbose: bool = False
