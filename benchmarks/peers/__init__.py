"""Benchmarks of kvforge against other runtimes: ONNX Runtime GenAI, transformers, llama.cpp, vLLM, and TensorRT
engines against the Torch reference."""
