"""One-off kernel and engine studies behind a design choice: ONNX Runtime kernels, LoRA formulations, grammar engines,
tracing cost, the test suite's floor."""
