"""The server's settings and its shared state (the engine once it is loaded, metrics, parsers)."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from portaserve.framework.errors import invalid
from portaserve.framework.server.errors import APIError, first_line
from portaserve.framework.server.limits import RequestLimits
from portaserve.framework.server.metrics import ServerMetrics
from portaserve.framework.server.tracing import Tracer

if TYPE_CHECKING:  # the engine client pulls in the engine; routes only need its type
    from portaserve.framework.engine.core_client import AsyncLLM
    from portaserve.framework.engine.startup import EngineSpec

logger = logging.getLogger("portaserve.server")

DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 2**20


@dataclass(frozen=True)
class ServerSettings:
    """What `portaserve serve` decides beyond the engine (the HTTP side)."""

    api_keys: tuple[str, ...] = ()
    #: Names clients may use for the model; the first one is reported. Empty: the engine's name.
    served_model_names: tuple[str, ...] = ()
    chat_template: str | None = None  # template text (``--chat-template`` already loaded)
    response_role: str = "assistant"
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    enable_request_id_headers: bool = False
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    return_tokens_as_token_ids: bool = False
    trust_request_chat_template: bool = False
    otlp_traces_endpoint: str | None = None
    #: Serve the admin routes (weight updates, weight-update groups, sleep / wake).
    enable_admin_api: bool = False
    #: Addresses (or CIDR networks) a weight-update group may connect to.
    weight_update_allowed_addresses: tuple[str, ...] = ()
    #: Images requests may load besides data: URLs (framework/multimodal/media.py).
    allowed_media_domains: tuple[str, ...] = ()
    allowed_local_media_path: str | None = None
    #: LoRA adapters served from the start: (name, path) pairs (--lora-modules name=path)
    lora_modules: tuple[tuple[str, str], ...] = ()
    #: folders runtime-loaded adapters must lie under (--allowed-lora-path); empty: the
    #: load / unload routes are off
    allowed_lora_paths: tuple[str, ...] = ()
    #: Where stored Responses-API responses live: a SQLite file, or None for memory.
    response_store: str | None = None
    max_stored_responses: int = 1024
    max_stored_response_bytes: int = 256 * 2**20
    #: Bounds on every size a request supplies (see limits.py).
    limits: RequestLimits = field(default_factory=RequestLimits)
    registry: Any = field(default=None, compare=False)  # a PluginRegistry for the parsers (tests)

    def check(self) -> None:
        """Fail before anything starts when the parser flags do not fit together."""
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise invalid("enable_auto_tool_choice", "needs --tool-call-parser NAME (the format the model writes calls in)")
        if self.tool_call_parser or self.reasoning_parser:
            # the parser registry loads the plugins (and torch): only when a parser is named
            from portaserve.framework.server.parsers import get_reasoning_parser, get_tool_parser

            if self.tool_call_parser:
                get_tool_parser(self.tool_call_parser, self.registry)
            if self.reasoning_parser:
                get_reasoning_parser(self.reasoning_parser, self.registry)
        if self.lora_modules and not all(name and path for name, path in self.lora_modules):
            raise invalid("lora_modules", "each adapter needs a name and a path (name=path)")
        if self.max_stored_responses < 1 or self.max_stored_response_bytes < 1:
            raise invalid("max_stored_responses", "--max-stored-responses and --max-stored-response-bytes must be >= 1")
        if self.max_request_body_bytes < 1:
            raise invalid("max_request_body_bytes", f"must be >= 1, got {self.max_request_body_bytes}")


class ServerState:
    """Shared by every route: the engine (None while it loads), metrics, parser classes."""

    def __init__(self, settings: ServerSettings, spec: EngineSpec | None = None) -> None:
        from portaserve.framework.server.parsers import get_reasoning_parser, get_tool_parser

        settings.check()
        self.settings = settings
        self.engine: AsyncLLM | None = None
        self.load_error: str | None = None
        self.spec = spec
        self.metrics: ServerMetrics | None = None
        self.tracer = Tracer()
        self._template_renderer = None  # started on the first request-supplied chat template
        self._media_policy = None  # built on the first request with an image (media_policy())
        self.reasoning_parser_cls = get_reasoning_parser(settings.reasoning_parser, settings.registry) if settings.reasoning_parser else None
        self.tool_parser_cls = get_tool_parser(settings.tool_call_parser, settings.registry) if settings.tool_call_parser else None
        #: adapter name -> LoRARequest (--lora-modules, then /v1/load_lora_adapter)
        self.loras: dict[str, Any] = {}
        self._lora_ids = 0
        self._lora_lock = threading.Lock()
        if spec is not None:
            self._make_metrics(spec)

    def _make_metrics(self, spec: EngineSpec) -> None:
        if self.metrics is None:
            self.metrics = ServerMetrics(self.model_names_for(spec)[0], spec.plan)

    def model_names_for(self, spec: EngineSpec | None) -> list[str]:
        if self.settings.served_model_names:
            return list(self.settings.served_model_names)
        name = spec.served_model_name if spec is not None else None
        return [name or "portaserve"]

    @property
    def model_names(self) -> list[str]:
        return self.model_names_for(self.spec)

    def render_chat(self, tokenizer: Any, messages: Any, *, request_template: str | None, **kwargs: Any) -> str:
        """A chat prompt's text: the server's or model's template in this process, a
        request's own template (with --trust-request-chat-template only) in a worker
        process stopped after --chat-template-timeout."""
        if request_template is None:
            return tokenizer.apply_chat_template(messages, chat_template=self.settings.chat_template, **kwargs)
        if not self.settings.trust_request_chat_template:
            raise invalid("chat_template", "per-request chat templates are disabled; start the server with "
                          "--trust-request-chat-template")
        if self._template_renderer is None:
            from portaserve.framework.server.template_renderer import IsolatedTemplateRenderer

            self._template_renderer = IsolatedTemplateRenderer()
        return self._template_renderer.render(
            self.settings.limits.chat_template_timeout, template=request_template, messages=messages,
            bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token, **kwargs,
        )

    def media_policy(self):
        """What requests may load as images (--allowed-media-domains, --allowed-local-media-path)."""
        if self._media_policy is None:
            from portaserve.framework.multimodal.media import MediaPolicy

            self._media_policy = MediaPolicy.create(self.settings.allowed_media_domains,
                                                    self.settings.allowed_local_media_path)
        return self._media_policy

    def add_lora(self, name: str, path: str, engine: Any) -> Any:
        """Check the adapter at `path` (through the engine's front end) and serve it as `name`."""
        from portaserve.framework.lora.request import LoRARequest

        with self._lora_lock:  # loads run on worker threads: one name, one id at a time
            if name in self.model_names or name in self.loras:
                raise invalid("lora_name", f"{name!r} is already served")
            self._lora_ids += 1
            request = LoRARequest(name, self._lora_ids, path)
            engine.processor._check_lora(request)
            self.loras[name] = request
            return request

    def lora_for(self, model: str) -> Any:
        """The LoRARequest a request's (checked) model name stands for, None for the base model."""
        return self.loras.get(model)

    def attach(self, engine: AsyncLLM) -> None:
        """The engine has started: routes may use it from now on."""
        for name, path in self.settings.lora_modules:
            self.add_lora(name, path, engine)
        self.spec = engine.spec
        self._make_metrics(self.spec)
        if self.metrics is not None:
            engine.add_stats_listener(self.metrics.on_step)
        self.engine = engine

    # ----- checks every route makes ------------------------------------------------------------

    def health(self) -> tuple[int, str]:
        """(HTTP status, reason) for /health: 200 ready, 503 loading, 500 failed or dead."""
        if self.load_error is not None:
            return 500, f"the engine failed to start: {first_line(self.load_error)}"
        engine = self.engine
        if engine is None:
            return 503, "the engine is loading"
        if engine.dead_reason is not None:
            return 500, f"the engine is dead: {first_line(engine.dead_reason)}"
        if not engine.is_healthy:
            return 503, "the engine is not ready"
        return 200, "ok"

    def require_engine(self) -> AsyncLLM:
        status, reason = self.health()
        if status != 200:
            raise APIError(status, reason)
        return self.engine

    def check_model(self, model: str | None) -> str:
        """The name to report for a request naming `model` (None: the default); 404 if unknown."""
        names = self.model_names
        if model is None or model == "":
            return names[0]
        if model not in names and model not in self.loras:
            served = ", ".join(repr(n) for n in [*names, *self.loras])
            raise APIError(404, f"The model `{model}` does not exist; this server serves {served}", "model")
        return model

    def check_priority(self, priority: int) -> None:
        config = getattr(self.spec, "config", None)
        if priority and getattr(config, "scheduling_policy", "fcfs") != "priority":
            raise invalid("priority", "is only allowed when the server runs with --scheduling-policy priority")
