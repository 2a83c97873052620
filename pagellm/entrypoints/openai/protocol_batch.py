"""Entrypoints stage: HTTP: the Files and Batch APIs' bodies, with OpenAI's field names.

A batch's input is a JSONL file uploaded with purpose "batch": one request per line,
`{"custom_id", "method": "POST", "url", "body"}`. Its output and error files hold one
result per line, `{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error"}`, as OpenAI writes them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/score", "/v1/rerank")
BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]
# A batch in one of these is done: nothing changes it any more.
FINAL_STATUSES = ("failed", "completed", "expired", "cancelled")


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["uploaded", "processed", "error"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


# OpenAI's bounds on a file's lifetime: an hour to 30 days after its creation.
MIN_FILE_LIFETIME_S = 3600
MAX_FILE_LIFETIME_S = 30 * 24 * 3600


class ExpiresAfter(BaseModel):
    """When a file expires (then it is deleted): `seconds` after its creation."""

    model_config = ConfigDict(extra="forbid")

    anchor: Literal["created_at"]
    seconds: int = Field(ge=MIN_FILE_LIFETIME_S, le=MAX_FILE_LIFETIME_S)


class BatchCreateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1, max_length=256)
    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/score", "/v1/rerank"]
    # OpenAI takes "24h" only; any whole number of hours (up to a week) is taken here.
    completion_window: str = Field("24h", pattern=r"^[1-9][0-9]{0,2}h$")
    metadata: dict[str, str] | None = Field(None, max_length=16)
    # The output and error files' lifetime (default: kept until deleted).
    output_expires_after: ExpiresAfter | None = None


class BatchRequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchInputTokensDetails(BaseModel):
    cached_tokens: int = 0


class BatchOutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class BatchUsage(BaseModel):
    """The tokens of the lines that answered 200, summed from their responses' usage."""

    input_tokens: int = 0
    output_tokens: int = 0
    total_tokens: int = 0
    input_tokens_details: BatchInputTokensDetails = Field(default_factory=BatchInputTokensDetails)
    output_tokens_details: BatchOutputTokensDetails = Field(default_factory=BatchOutputTokensDetails)

    def add(self, response: Any) -> None:
        usage = response.get("usage") if isinstance(response, dict) else None
        if not isinstance(usage, dict):
            return
        # A rerank's usage has total_tokens only: all of them prompt tokens.
        prompt = int(usage.get("prompt_tokens", usage.get("total_tokens")) or 0)
        completion = int(usage.get("completion_tokens") or 0)
        self.input_tokens += prompt
        self.output_tokens += completion
        self.total_tokens += prompt + completion
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            self.input_tokens_details.cached_tokens += int(details.get("cached_tokens") or 0)


class BatchError(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError] = Field(default_factory=list)


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: BatchRequestCounts = Field(default_factory=BatchRequestCounts)
    usage: BatchUsage = Field(default_factory=BatchUsage)
    model: str | None = None  # the model the lines' answers name
    metadata: dict[str, str] | None = None
    output_expires_after: ExpiresAfter | None = None  # as created: its result files' lifetime


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchObject]
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None


def result_line(
    request_id: str, custom_id: str | None, status_code: int | None, body: Any, error: dict[str, Any] | None
) -> dict[str, Any]:
    """One line of an output or error file: a response (any status), or an error that
    kept the line from running at all (response null)."""
    response = None
    if status_code is not None:
        response = {"status_code": status_code, "request_id": request_id, "body": body}
    return {"id": request_id, "custom_id": custom_id, "response": response, "error": error}
