"""Routes for RL loops: live weight updates and sleep / wake (vLLM's and SGLang's names).

- `POST /v1/update_weights` `{"path": "/ckpt/step-100"}`: reload from a checkpoint folder.
- `POST /v1/init_weight_update_group` `{"master_address", "master_port", "rank_offset",
  "world_size"}`: join a trainer's process group (the trainer is rank 0).
- `POST /v1/update_weights_from_distributed` `{"names", "dtypes", "shapes"}`: receive the
  trainer's broadcast of those tensors.
- `POST /v1/destroy_weight_update_group`, `GET /v1/weights_info`.
- `POST /sleep?level=1|2`, `POST /wake_up[?tags=weights&tags=kv_cache]`, `GET /is_sleeping`.

Requests already running when an update or sleep arrives finish on the old weights;
requests sent meanwhile wait and run on the new ones (while asleep they are rejected).
Each successful update raises the weights version `/v1/models` reports. A bad update
answers 400 in OpenAI's error shape, naming the tensor, and the old weights keep serving.
The API key applies here as on every route but /health (the gateway middleware). The
routes exist only with `--enable-admin-api`: they read server-side paths, connect to a
trainer's address (which must be in `--weight-update-allowed-addresses`) and stop serving.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

from fastapi import APIRouter, FastAPI, Query, Request
from pydantic import BaseModel, ConfigDict, Field

router = APIRouter()

#: Response header naming the weights version a generation ran on.
WEIGHTS_VERSION_HEADER = b"x-weights-version"
# Per HTTP request: a one-item list the engine-output loop fills with the version of the
# outputs it saw (every output of one request has the same version: updates wait for
# running requests), read when the response starts.
_request_weights_version: ContextVar[list | None] = ContextVar("portaserve_weights_version", default=None)


def note_weights_version(output: Any) -> None:
    """Record the weights version of an engine output for this HTTP request's header."""
    holder = _request_weights_version.get()
    version = getattr(output, "weights_version", None)
    if holder is not None and version is not None:
        holder[0] = version


class WeightsVersionMiddleware:
    """Pure ASGI: adds `X-Weights-Version` to responses of requests that generated."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        holder: list = [None]
        token = _request_weights_version.set(holder)

        async def sending(message):
            if message["type"] == "http.response.start" and holder[0] is not None:
                message = dict(message)
                message["headers"] = [*message.get("headers", []), (WEIGHTS_VERSION_HEADER, str(holder[0]).encode())]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            _request_weights_version.reset(token)


def install(app: FastAPI, admin: bool) -> None:
    """Add the weights-version header to the server, and these routes when `admin`
    (`--enable-admin-api`): without it they do not exist (404)."""
    if admin:
        app.include_router(router)
    app.add_middleware(WeightsVersionMiddleware)


def check_group_address(settings: Any, address: str) -> None:
    """A trainer's process-group address must be one the operator allowed
    (`--weight-update-allowed-addresses`): the server connects to it, so an arbitrary
    request-supplied address would be a server-side request forgery.

    :raises InvalidParameterError: on `master_address`, naming the allowed ones.
    """
    import ipaddress

    from portaserve.framework.errors import invalid

    allowed = tuple(settings.weight_update_allowed_addresses)
    for entry in allowed:
        if address == entry:
            return
        try:
            if ipaddress.ip_address(address) in ipaddress.ip_network(entry, strict=False):
                return
        except ValueError:  # a host name, or an entry that is not a network
            continue
    raise invalid(
        "master_address",
        f"{address!r} is not an allowed weight-update address; allowed: {list(allowed) or 'none'} "
        "(start the server with --weight-update-allowed-addresses ADDRESS|CIDR ...)",
    )


class UpdateWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(..., min_length=1, description="checkpoint folder, readable on every node")


class InitWeightUpdateGroupRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    master_address: str = Field(..., min_length=1)
    master_port: int = Field(..., ge=1, le=65535)
    rank_offset: int = Field(1, ge=1, description="group rank of this engine's rank 0 (the trainer is rank 0)")
    world_size: int = Field(..., ge=2)
    timeout_s: float | None = Field(None, gt=0)


class UpdateWeightsFromDistributedRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    names: list[str] = Field(..., min_length=1)
    dtypes: list[str]
    shapes: list[list[int]]


async def _call(raw: Request, method: str, *args: Any) -> Any:
    engine = raw.app.state.portaserve.require_engine()
    return await engine.call(method, *args)


@router.post("/v1/update_weights")
async def update_weights(body: UpdateWeightsRequest, raw: Request):
    return await _call(raw, "update_weights", body.path)


@router.post("/v1/init_weight_update_group")
async def init_weight_update_group(body: InitWeightUpdateGroupRequest, raw: Request):
    check_group_address(raw.app.state.portaserve.settings, body.master_address)
    return await _call(raw, "init_weight_update_group", body.master_address, body.master_port, body.rank_offset,
                       body.world_size, body.timeout_s)


@router.post("/v1/update_weights_from_distributed")
async def update_weights_from_distributed(body: UpdateWeightsFromDistributedRequest, raw: Request):
    return await _call(raw, "update_weights_from_distributed", body.names, body.dtypes, body.shapes)


@router.post("/v1/destroy_weight_update_group")
async def destroy_weight_update_group(raw: Request):
    await _call(raw, "destroy_weight_update_group")
    return {"ok": True}


@router.get("/v1/weights_info")
async def weights_info(raw: Request):
    return await _call(raw, "weights_info")


@router.post("/sleep")
async def sleep(raw: Request, level: int = Query(1, ge=1, le=2)):
    return await _call(raw, "sleep", level)


@router.post("/wake_up")
async def wake_up(raw: Request, tags: list[str] | None = Query(None)):
    return await _call(raw, "wake_up", tags)


@router.get("/is_sleeping")
async def is_sleeping(raw: Request):
    return {"is_sleeping": bool(await _call(raw, "is_sleeping"))}
