"""The ONNX Runtime variant of a bundle's graph (docs/ort-variant.md): `variant` builds and caches it from the
rewrites beside it (`fusions`: RMSNorm and RoPE chains as ORT's fused kernels; `attention`: GroupQueryAttention
over the `packed_cache`; `moe`: unchosen experts skipped). The bundle's own graph is never changed."""
