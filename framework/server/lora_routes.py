"""Loading and unloading LoRA adapters at run time (vLLM's routes and bodies).

- `POST /v1/load_lora_adapter {"lora_name", "lora_path"}`: the adapter is read and
  checked (a 400 names what is wrong) and served from then on under `lora_name`;
- `POST /v1/unload_lora_adapter {"lora_name"}`: new requests naming it get a 404;
  requests already running on it finish (they hold the adapter; the workers' slots let
  it go by LRU).

They read files a request names, so they are off (404) unless the server runs with
`--enable-lora` and `--allowed-lora-path DIR`, and a path must lie under one of those
folders (symbolic links resolved). The API key covers them like every route.
"""

from __future__ import annotations

import asyncio
import os

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from portaserve.framework.errors import invalid
from portaserve.framework.server.errors import APIError
from portaserve.framework.server.protocol import OpenAIBaseModel
from portaserve.framework.server.state import ServerState


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str
    lora_int_id: int | None = None


def _allowed(path: str, folders: tuple[str, ...]) -> str:
    real = os.path.realpath(path)
    for folder in folders:
        root = os.path.realpath(folder)
        if os.path.commonpath([real, root]) == root:
            return real
    raise invalid("lora_path", f"{path!r} is not under an allowed folder (--allowed-lora-path: "
                               f"{', '.join(folders)})")


def install(app: FastAPI, state: ServerState) -> None:
    def enabled() -> None:
        engine = state.require_engine()
        if not (engine.spec.config.enable_lora and state.settings.allowed_lora_paths):
            raise APIError(404, "loading adapters at run time is off: start the server with --enable-lora and "
                                "--allowed-lora-path DIR")

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        enabled()
        if not body.lora_name or len(body.lora_name) > 256:
            raise invalid("lora_name", "must be 1 to 256 characters")
        path = _allowed(body.lora_path, state.settings.allowed_lora_paths)
        # reading and checking the files does not block the event loop
        await asyncio.to_thread(state.add_lora, body.lora_name, path, state.engine)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        enabled()
        if state.loras.pop(body.lora_name, None) is None:
            raise APIError(404, f"no adapter named {body.lora_name!r} is loaded", "lora_name")
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
