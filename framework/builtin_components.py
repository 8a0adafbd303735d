"""The framework's own components (pure torch), registered like any plugin's."""

from __future__ import annotations

from .hookspecs import hookimpl

PORTASERVE_CONTRACT = "1.6"


@hookimpl
def portaserve_quant_methods():
    return {
        "none": "portaserve.framework.quantization.unquantized:UnquantizedMethod",
        "int8": "portaserve.framework.quantization.int8:Int8WeightOnlyMethod",
        "fp8": "portaserve.framework.quantization.fp8:Fp8Method",
        "compressed-tensors": "portaserve.framework.quantization.compressed_tensors:CompressedTensorsMethod",
        "gguf": "portaserve.framework.quantization.gguf:GGUFMethod",
    }


@hookimpl
def portaserve_op_specs():
    from .op_references import BUILTIN_OP_SPECS

    return BUILTIN_OP_SPECS


_PARSERS = "portaserve.framework.server.parsers"


@hookimpl
def portaserve_reasoning_parsers():
    return {
        "deepseek_r1": f"{_PARSERS}.reasoning:DeepSeekR1ReasoningParser",
        "qwen3": f"{_PARSERS}.reasoning:Qwen3ReasoningParser",
    }


@hookimpl
def portaserve_tool_parsers():
    return {
        "hermes": f"{_PARSERS}.tools:HermesToolParser",
        "llama3_json": f"{_PARSERS}.tools:Llama3JsonToolParser",
    }


@hookimpl
def portaserve_structured_output_backends():
    return {
        "xgrammar": "portaserve.framework.structured.xgrammar_backend:XgrammarBackend",
        "llguidance": "portaserve.framework.structured.llguidance_backend:LlguidanceBackend",
    }
