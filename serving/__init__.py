"""kvforge.serving: a bundle behind NVIDIA Triton Inference Server, with continuous batching.

    kvforge triton runs/tiny/fp32 -o repo        # a model repository Triton runs unchanged
    kvforge serve runs/tiny/fp32                 # the server from the nvidia-pytriton wheel, here

The model (triton_model.py) runs kvforge's runtime with its continuous batcher
(kvforge.runtime.Batcher) and speaks Triton's generate extension
(requests.py); server.py starts and stops the server.
"""

from kvforge.bundle import Bundle

from .preflight import check_python_backend
from .repository import repository_model, write_repository
from .server import TritonServer, triton_distribution

__all__ = ["TritonServer", "check_python_backend", "repository_model", "serve", "triton_distribution", "write_repository"]


def serve(source, model_name: str | None = None, *, host: str = "127.0.0.1", http_port: int = 8000, grpc_port: int = 8001,
          metrics_port: int = 8002, instances: int = 1, max_batch: int = 8, max_cache_tokens: int | None = None,
          backend: str = "auto", echo=print) -> int:
    """Serve a bundle (or a model source, exported to FP32 first) until SIGTERM or Ctrl-C; returns the exit code."""
    import signal
    import tempfile
    from pathlib import Path

    triton_distribution()  # a missing server is reported before any export
    check_python_backend()  # and a Triton whose Python backend cannot take this NumPy, before a server that hangs
    with tempfile.TemporaryDirectory(prefix="kvforge-serve-") as work:
        bundle = Path(source)
        if not Bundle.is_bundle(source):
            from kvforge.export import export  # torch: only when a model source must be exported first

            echo(f"{source} is not a bundle: exporting it (FP32) first")
            bundle = export(source, Path(work) / "bundle").path
        repo = write_repository(bundle, Path(work) / "repository", model_name=model_name, instances=instances,
                                max_batch=max_batch, max_cache_tokens=max_cache_tokens, backend=backend)
        name = repository_model(repo)
        server = TritonServer(repo, host, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port)

        def on_signal(signum, frame):  # SIGTERM stops the server as Ctrl-C does
            raise KeyboardInterrupt

        # SIGINT too, explicitly: a process started in the background of a non-interactive shell inherits SIGINT
        # ignored, and Python then installs no KeyboardInterrupt of its own (Ctrl-C / kill -INT would do nothing)
        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            server.start()
            echo(f"serving {bundle} as model {name!r} on Triton Inference Server")
            echo(f"  HTTP    {server.url()}  (POST /v2/models/{name}/generate, /generate_stream; GET /v2/health/ready)")
            echo(f"  gRPC    {server.client_host}:{server.grpc_port}")
            echo(f"  metrics http://{server.client_host}:{server.metrics_port}/metrics")
            echo("Ctrl-C or SIGTERM stops it.")
            code = server.wait()
            why = f": {server.failure}" if server.failure else ""
            echo(f"tritonserver exited on its own ({code}){why}:\n{server.log_tail()}")
            return code or 1
        except KeyboardInterrupt:
            echo("stopping tritonserver ...")
            code = server.stop()
            echo(f"stopped ({code})")
            return 0 if code in (0, None) else code
        finally:
            server.stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
