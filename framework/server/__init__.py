"""portaserve.framework.server: the OpenAI-compatible HTTP server (`portaserve serve`).

- `app`: the FastAPI application factory, the API-key / body-limit / request-id gateway, CORS;
- `protocol`: pydantic request and response models (OpenAI's and vLLM's field names);
- `serving_chat`, `serving_completion`, `serving_embedding`, `serving_tokens`: the routes' logic;
- `serving_common`: submitting to the engine, SSE streaming, disconnects, logprobs and usage;
- `parsers/`: reasoning and tool-call parsers, found by name through the plugin registry;
- `errors`, `metrics`, `tracing`, `state`: error shapes, Prometheus metrics, OpenTelemetry, shared state.
"""
