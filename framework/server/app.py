"""The FastAPI application: routes, the API-key / body-size / request-id gateway, CORS, and
the engine's lifecycle.

`create_app(settings, engine=...)` serves an engine that has already started;
`create_app(settings, engine_factory=...)` starts listening at once and loads the engine
in the background: `/health` answers 503 while it loads, 200 when it is ready, and 500
if it failed to start or died later (every other route answers the same error meanwhile).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from portaserve import __version__
from portaserve.framework.server.errors import APIError, error_body, error_body_for, install_exception_handlers
from portaserve.framework.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    GenerateRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from portaserve.framework.server.serving_chat import ChatService
from portaserve.framework.server.serving_completion import CompletionService
from portaserve.framework.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from portaserve.framework.server.serving_embedding import EmbeddingService
from portaserve.framework.server.serving_messages import MessagesService
from portaserve.framework.server.response_store import make_store
from portaserve.framework.server.responses_protocol import ResponsesRequest
from portaserve.framework.server.serving_responses import ResponsesService
from portaserve.framework.server.serving_tokens import TokenService
from portaserve.framework.server.state import ServerSettings, ServerState
from portaserve.framework.server import lora_routes, weights_routes
from portaserve.framework.server.openapi import honest_openapi

if TYPE_CHECKING:
    from portaserve.framework.engine.core_client import AsyncLLM
    from portaserve.framework.engine.startup import EngineSpec

logger = logging.getLogger("portaserve.server")

#: Routes anyone may call without the API key (load balancers probe them).
PUBLIC_PATHS = frozenset({"/health"})
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


class GatewayMiddleware:
    """Pure ASGI (so streaming and disconnect detection are untouched): API key, body limit, request id."""

    def __init__(self, app, state: ServerState) -> None:
        self.app = app
        self.state = state
        self.keys = [k.encode() for k in state.settings.api_keys]

    async def _reply(self, scope, send, status: int, message: str, headers: list | None = None) -> None:
        import json

        body = json.dumps(error_body_for(scope["path"], status, message)).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())] + (headers or [])})
        await send({"type": "http.response.body", "body": body})

    def _caller(self, scope) -> str | None:
        """Who is calling: "" without keys (or on a public route), the key's fingerprint
        with a valid key (`Authorization: Bearer` or Anthropic's `x-api-key`), None otherwise."""
        if not self.keys or scope["path"] in PUBLIC_PATHS or scope["method"] == "OPTIONS":
            return ""
        headers = dict(scope.get("headers") or [])
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        candidates = [token.strip()] if scheme.lower() == b"bearer" else []
        if b"x-api-key" in headers:
            candidates.append(headers[b"x-api-key"].strip())
        for token in candidates:
            for key in self.keys:
                if hmac.compare_digest(token, key):
                    return hashlib.sha256(key).hexdigest()[:16]
        return None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        caller = self._caller(scope)
        if caller is None:
            await self._reply(scope, send, 401, "invalid or missing API key: send 'Authorization: Bearer <key>' "
                              "or 'x-api-key: <key>'", [(b"www-authenticate", b"Bearer")])
            return
        headers = dict(scope.get("headers") or [])
        request_id = headers.get(b"x-request-id", b"").decode("latin-1") or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        # stored responses belong to the key that created them
        scope["state"]["caller"] = caller
        if scope["method"] in _BODY_METHODS:
            limit = self.state.settings.max_request_body_bytes
            declared = headers.get(b"content-length")
            too_big = f"the request body is larger than the server's limit of {limit} bytes (--max-request-body-bytes)"
            if declared is not None and declared.isdigit() and int(declared) > limit:
                await self._reply(scope, send, 413, too_big)
                return
            chunks, size = [], 0
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    await self._reply(scope, send, 413, too_big)
                    return
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
            receive = _replay(b"".join(chunks), receive)
        if self.state.settings.enable_request_id_headers:
            send = _with_header(send, b"x-request-id", request_id.encode("latin-1"))
        await self.app(scope, receive, send)


def _replay(body: bytes, receive):
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # afterwards only http.disconnect arrives

    return replayed


def _with_header(send, name: bytes, value: bytes):
    async def sending(message):
        if message["type"] == "http.response.start":
            message = dict(message)
            message["headers"] = [*message.get("headers", []), (name, value)]
        await send(message)

    return sending


def create_app(
    settings: ServerSettings | None = None,
    *,
    engine: AsyncLLM | None = None,
    engine_factory: Callable[[], Awaitable[AsyncLLM]] | None = None,
    spec: EngineSpec | None = None,
) -> FastAPI:
    """The server for one engine (see the module docstring)."""
    settings = settings or ServerSettings()
    state = ServerState(settings, spec if spec is not None or engine is None else engine.spec)
    if engine is not None:
        state.attach(engine)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loader = None
        if engine_factory is not None and state.engine is None:
            loader = asyncio.ensure_future(_load(state, engine_factory))
        try:
            yield
        finally:
            if loader is not None and not loader.done():
                loader.cancel()
                with contextlib.suppress(BaseException):
                    await loader
            if engine_factory is not None and state.engine is not None:
                with contextlib.suppress(Exception):
                    await state.engine.shutdown()
            store.close()

    app = FastAPI(title="portaserve", version=__version__, lifespan=lifespan)
    app.state.portaserve = state
    install_exception_handlers(app)
    chat, completion = ChatService(state), CompletionService(state)
    embedding, tokens = EmbeddingService(state), TokenService(state)
    messages = MessagesService(state, chat)
    store = make_store(settings.response_store, settings.max_stored_responses, settings.max_stored_response_bytes)
    responses = ResponsesService(state, chat, store)

    @app.get("/health")
    async def health() -> Response:
        status, reason = state.health()
        if status == 200:
            return Response(status_code=200)
        return JSONResponse(error_body(status, reason), status_code=status)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    def model_cards() -> list[ModelCard]:
        spec = state.spec
        demo = spec is not None and spec.is_demo
        engine = state.engine
        takes_images = engine is not None and getattr(engine.processor, "mm_processor", None) is not None
        created = int(time.time())
        return [
            ModelCard(
                id=name,
                display_name=name,
                created=created,
                created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created)),
                root=spec.model_path if spec is not None else None,
                max_model_len=spec.max_model_len if spec is not None else None,
                weights_version=state.engine.weights_version if state.engine is not None else 0,
                demo=demo,
                description="portaserve's demo checkpoint: RANDOM WEIGHTS, the output is gibberish" if demo else None,
                input_modalities=["text", "image"] if takes_images else ["text"],
            )
            for name in state.model_names
        ] + [
            ModelCard(id=name, display_name=name, created=created, root=lora.lora_path, parent=state.model_names[0],
                      created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created)),
                      max_model_len=spec.max_model_len if spec is not None else None)
            for name, lora in list(state.loras.items())
        ]

    @app.get("/v1/models")
    async def models():
        cards = model_cards()
        return ModelList(data=cards, first_id=cards[0].id if cards else None,
                         last_id=cards[-1].id if cards else None).model_dump(mode="json")

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        for card in model_cards():
            if card.id == model_id:
                return card.model_dump(mode="json")
        raise APIError(404, f"The model `{model_id}` does not exist; this server serves "
                            f"{', '.join(repr(n) for n in state.model_names)}", "model")

    @app.get("/metrics")
    async def metrics() -> Response:
        if state.metrics is None:
            return PlainTextResponse("", media_type="text/plain; version=0.0.4")
        engine = state.engine
        if engine is not None and engine.is_healthy:
            with contextlib.suppress(Exception):  # a fresh snapshot; the last step's otherwise
                state.metrics.update_stats(await engine.call("stats", timeout=2.0))
            if engine.spec.config.enable_lora:
                with contextlib.suppress(Exception):
                    state.metrics.update_lora_stats(await engine.call("lora_stats", timeout=2.0))
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw: Request):
        return await chat.create(request, raw)

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw: Request):
        return await completion.create(request, raw)

    @app.post("/v1/responses")
    async def create_response(request: ResponsesRequest, raw: Request):
        return await responses.create(request, raw)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, raw: Request):
        return await responses.retrieve(response_id, raw)

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(response_id: str, raw: Request):
        return await responses.input_items(response_id, raw)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, raw: Request):
        return await responses.delete(response_id, raw)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str, raw: Request):
        return await responses.cancel(response_id, raw)

    @app.post("/v1/messages")
    async def anthropic_messages(request: MessagesRequest, raw: Request):
        return await messages.create(request, raw)

    @app.post("/v1/messages/count_tokens")
    async def anthropic_count_tokens(request: CountTokensRequest, raw: Request):
        return await messages.count_tokens(request, raw)

    @app.post("/v1/embeddings")
    async def embeddings(request: EmbeddingRequest, raw: Request):
        return await embedding.create(request, raw)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest):
        return await tokens.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest):
        return await tokens.detokenize(request)

    @app.post("/inference/v1/generate")
    async def generate(request: GenerateRequest, raw: Request):
        return await tokens.generate(request, raw)

    # the X-Weights-Version header; the admin routes (weight updates, sleep / wake) only
    # with --enable-admin-api
    weights_routes.install(app, admin=settings.enable_admin_api)
    lora_routes.install(app, state)

    plain_openapi = app.openapi

    def openapi() -> dict:
        # once: the pydantic-derived schema plus this server's limits and model names
        if app.openapi_schema is None:
            spec = state.spec
            honest_openapi(plain_openapi(), settings.limits, state.model_names, spec.max_model_len if spec else None,
                           (spec.vocab_size or None) if spec else None)
        return app.openapi_schema

    app.openapi = openapi
    app.add_middleware(GatewayMiddleware, state=state)
    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(settings.allowed_origins),
        allow_methods=list(settings.allowed_methods),
        allow_headers=list(settings.allowed_headers),
        allow_credentials=settings.allow_credentials,
    )
    return app


async def _load(state: ServerState, factory: Callable[[], Awaitable[AsyncLLM]]) -> None:
    t0 = time.monotonic()
    try:
        engine = await factory()
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # reported by /health; the process keeps serving errors
        state.load_error = f"{type(exc).__name__}: {exc}"
        logger.error("the engine failed to start: %s", state.load_error)
        return
    state.attach(engine)
    logger.info("engine ready in %.1fs; serving %s", time.monotonic() - t0, ", ".join(state.model_names))
