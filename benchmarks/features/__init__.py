"""Benchmarks of kvforge's own capabilities: serving, batching, constrained and speculative decoding, adapters,
other model kinds, quantization accuracy, export cost."""
