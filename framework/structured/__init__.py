"""Structured outputs (issue #26): constraints on what a request may generate.

`params.py`: the request surface (`StructuredOutputsParams`, and the OpenAI / vLLM
request fields mapped onto it). `xgrammar_backend.py` and `llguidance_backend.py`: the
two built-in backends of the `StructuredOutputBackend` interface
(framework/interfaces/structured_output.py). `manager.py`: the engine core's side:
compiling off the engine loop with a cache, one matcher per sequence, the step's
bitmask.
"""
