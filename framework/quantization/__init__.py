"""portaserve.framework.quantization: the built-in QuantMethods (pure torch, vendor-free).

- `int8.Int8WeightOnlyMethod` ("int8"): int8 weights with per-output-channel symmetric
  scales, activations unquantized; quantized online from a bf16/fp32 checkpoint or
  loaded pre-quantized. The matmul is picked from `int8_kernels` by the platform's features.
- `fp8.Fp8Method` ("fp8"): e4m3 weights with per-channel scales, activations quantized
  per token on the fly, `torch._scaled_mm`; needs the platform feature "fp8_matmul".
- `compressed_tensors.CompressedTensorsMethod` ("compressed-tensors"): checkpoints
  quantized elsewhere (llm-compressor's W8A16 int8 and FP8_DYNAMIC channel schemes),
  dispatched to the two methods above by the checkpoint's scheme.

They are registered through the framework's own `portaserve_quant_methods` hookimpl,
like any plugin's, and gated in the ExecutionPlan by `QuantMethod.unsupported_reason`.
"""
