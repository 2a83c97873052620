"""Entrypoints stage: LoRA adapters on the server, with vLLM's flags and routes.

`--lora-modules name=path ...` names adapters at start; `POST /v1/load_lora_adapter`
{"lora_name", "lora_path"} and `POST /v1/unload_lora_adapter` {"lora_name"} change the set
while serving (behind the API key like every route). A request selects an adapter by its
`model`; `GET /v1/models` lists each with `parent` set to the base model.

An adapter's folder is read and checked when it is named (at start, or by the load route,
off the event loop), so that a bad one is a 400 naming it. Each name gets a new id: a name
unloaded and loaded again (perhaps from another folder) never shares cached prefixes or a
slot with its earlier self. Unloading takes the name away from new requests at once (a 404
after); requests already running under the adapter finish under it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
from collections.abc import Callable, Iterable

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from pagellm.config.engine_config import LoRAConfig
from pagellm.entrypoints.openai.errors import APIError
from pagellm.entrypoints.openai.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from pagellm.errors import ConfigError, InvalidRequestError
from pagellm.lora.request import LoRARequest


class AdapterRegistry:
    """The adapters the server serves by name."""

    def __init__(
        self, base_model: str, lora_config: LoRAConfig | None, read: Callable[[str, str], None],
        on_added: Callable[[LoRARequest], None] | None = None,
    ) -> None:  # fmt: skip
        """read(name, path): reads and checks an adapter as the engine's ranks will (raises
        InvalidRequestError); on_added: told of each adapter once checked (the engine, so that
        it does not read the folder again on its own thread)."""
        self.base_model = base_model
        self.read = read
        self.on_added = on_added
        self.lora_config = lora_config
        self.by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # loads run on worker threads

    def get(self, name: str) -> LoRARequest | None:
        return self.by_name.get(name)

    def names(self) -> list[str]:
        return list(self.by_name)

    def add(self, name: str, path: str) -> LoRARequest:
        """Check the adapter's folder and serve it under `name` (InvalidRequestError, with
        `parameter` lora_name or lora_path, when it cannot be)."""
        if self.lora_config is None:
            raise InvalidRequestError("LoRA adapters need the server started with --enable-lora", "lora_name")
        with self._lock:
            return self._add(name, path)

    def _add(self, name: str, path: str) -> LoRARequest:
        if not name:
            raise InvalidRequestError("lora_name must not be empty", "lora_name")
        if name == self.base_model:
            raise InvalidRequestError(f"lora_name {name!r} is the base model's name", "lora_name")
        if name in self.by_name:
            raise InvalidRequestError(f"the LoRA adapter {name!r} is already loaded", "lora_name")
        self.read(name, path)
        request = LoRARequest(name, next(self._ids), path)
        if self.on_added is not None:
            self.on_added(request)
        self.by_name[name] = request
        return request

    def remove(self, name: str) -> None:
        if self.by_name.pop(name, None) is None:
            raise APIError(404, f"The LoRA adapter `{name}` is not loaded.", param="lora_name", code="model_not_found")


def parse_lora_modules(values: Iterable[str]) -> list[tuple[str, str]]:
    """--lora-modules entries: `name=path`, or vLLM's JSON form {"name": ..., "path": ...}."""
    modules = []
    for value in values:
        if value.lstrip().startswith("{"):
            try:
                entry = json.loads(value)
                modules.append((str(entry["name"]), str(entry["path"])))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ConfigError(f"--lora-modules {value!r}: expected name=path or {{\"name\", \"path\"}} ({e})") from None
            continue
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--lora-modules {value!r}: expected name=path")
        modules.append((name, path))
    return modules


def add_lora_routes(app: FastAPI, adapters: AdapterRegistry, responses: dict) -> None:
    """The adapter routes; in the published schema only where --enable-lora makes them
    usable (without it they answer 400, saying so)."""
    published = adapters.lora_config is not None

    @app.post("/v1/load_lora_adapter", responses=responses, include_in_schema=published)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> JSONResponse:
        request = await asyncio.to_thread(adapters.add, body.lora_name, body.lora_path)
        return JSONResponse({"object": "lora_adapter", "lora_name": request.lora_name, "status": "loaded"})

    @app.post("/v1/unload_lora_adapter", responses=responses, include_in_schema=published)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> JSONResponse:
        adapters.remove(body.lora_name)
        return JSONResponse({"object": "lora_adapter", "lora_name": body.lora_name, "status": "unloaded"})
