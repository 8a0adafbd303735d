"""portaserve.kernels: portable kernels that no single platform owns, and the attention
backends built on them: Triton kernels (each beside its torch reference), for every
platform that declares the "triton" feature, and the XLA paged attention (torch_xla
ops, static shapes), for the TPU.

- `reshape_and_cache`, `paged_attention` (unified prefill/decode, split-K), `rms_norm`,
  `activation` (SiLU-and-mul), `rotary`: kernels + launchers + `*_ref` references;
  `kv_layout`: the paged KV-cache layout they share.
- `triton_backend.TritonAttentionBackend` ("triton": cuda, rocm, xpu; cpu under
  TRITON_INTERPRET=1) and `ops.triton_ops(platforms)` (the fused ops as OpImpls).
- `xla_attention.XlaPagedAttentionBackend` ("xla_paged": tpu) and `xla_buckets`.
- `bench`: `portaserve bench kernels`.

Nothing here imports triton at package import time.
"""
