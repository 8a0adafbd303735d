"""Optional OpenTelemetry tracing: one span per request, when opentelemetry is installed.

With the `opentelemetry-api` package present, every chat / completion / generate
request runs in a span named after its route, with the `gen_ai.*` attributes vLLM
records (request model, max tokens, temperature, top_p, n, usage, latency, finish
reasons). The API alone does nothing: spans go somewhere only once a tracer provider
is configured, by the application embedding the server or by
``--otlp-traces-endpoint URL`` (which needs `opentelemetry-sdk` and
`opentelemetry-exporter-otlp`). Without the package, tracing is a no-op.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("portaserve.server")


def _api():
    try:
        from opentelemetry import trace
    except ImportError:
        return None
    return trace


def configure_otlp(endpoint: str, service_name: str = "portaserve") -> None:
    """Export spans to an OTLP collector; a clear error if the packages are missing."""
    try:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise ValueError(
            f"otlp_traces_endpoint: tracing needs opentelemetry-sdk and opentelemetry-exporter-otlp "
            f"(pip install opentelemetry-sdk opentelemetry-exporter-otlp): {exc}"
        ) from None
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(provider)


class Tracer:
    """Request spans, or nothing when opentelemetry is not installed.

    Spans are started and ended explicitly (not made current), so a streamed response's
    span can end in the task that streams it, when the last event is sent.
    """

    def __init__(self) -> None:
        trace = _api()
        self._tracer = trace.get_tracer("portaserve") if trace is not None else None

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def start(self, name: str, headers: Any = None, **attributes: Any) -> Any:
        """A started span for one request (a child of a `traceparent` header's context, if any), or None."""
        if self._tracer is None:
            return None
        ctx = None
        if headers is not None and "traceparent" in headers:
            try:
                from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

                ctx = TraceContextTextMapPropagator().extract(dict(headers))
            except Exception:  # a malformed header must not fail the request
                ctx = None
        span = self._tracer.start_span(name, context=ctx)
        set_attributes(span, attributes)
        return span


def end_span(span: Any, error: BaseException | None = None, **attributes: Any) -> None:
    """Record the final attributes (and an error) and end the span; None is a no-op."""
    if span is None:
        return
    set_attributes(span, attributes)
    if error is not None:
        span.record_exception(error)
    span.end()


def set_attributes(span: Any, attributes: dict[str, Any]) -> None:
    if span is None:
        return
    for key, value in attributes.items():
        if value is None:
            continue
        if isinstance(value, (list, tuple)):
            value = [v for v in value if v is not None]
        span.set_attribute(key, value)
