"""kvforge.serving: a bundle behind NVIDIA Triton Inference Server, with continuous batching.

    kvforge triton runs/tiny/fp32 -o repo        # a model repository Triton runs unchanged
    kvforge serve runs/tiny/fp32                 # the server from the nvidia-pytriton wheel, here

The model (triton_model.py) runs kvforge's runtime with its continuous batcher
(kvforge.runtime.Batcher) and speaks Triton's generate extension
(requests.py); in the same process, over the same batcher, the OpenAI API
(openai_api.py, openai_app.py; tool calls: tools.py). kinds.py says what each
model kind serves; server.py starts and stops the server.
"""

from kvforge.bundle import Bundle
from kvforge.errors import KvforgeError
from kvforge.runtime import BatchOptions

from .preflight import check_python_backend
from .repository import repository_model, write_repository
from .server import TritonServer, triton_distribution

__all__ = ["TritonServer", "check_python_backend", "repository_model", "serve", "triton_distribution", "write_repository"]


def serve(source, model_name: str | None = None, *, host: str = "127.0.0.1", http_port: int = 8000, grpc_port: int = 8001,
          metrics_port: int = 8002, instances: int = 1, batching: BatchOptions | None = None,
          backend: str = "auto", openai_port: int | None = 8080, api_key: str | None = None, echo=print) -> int:
    """Serve a bundle (or a model source, exported to FP32 first) until SIGTERM or Ctrl-C; returns the exit code.
    batching: the continuous batcher's settings (kvforge.runtime.BatchOptions; default: its defaults);
    openai_port: the OpenAI API's port (0: a free one; None: no OpenAI API); api_key: what its clients must send."""
    import signal
    import tempfile
    from pathlib import Path

    from .server import free_port
    from .triton_model import API_KEY_ENV

    triton_distribution()  # a missing server is reported before any export
    check_python_backend()  # and a Triton whose Python backend cannot take this NumPy, before a server that hangs
    if api_key is not None and openai_port is None:
        raise KvforgeError("an API key guards the OpenAI API, which is off (no OpenAI port)")
    if api_key is not None and not api_key.strip():
        raise KvforgeError("the API key is empty")
    with tempfile.TemporaryDirectory(prefix="kvforge-serve-") as work:
        bundle = Path(source)
        if not Bundle.is_bundle(source):
            from kvforge.export import export  # torch: only when a model source must be exported first

            echo(f"{source} is not a bundle: exporting it (FP32) first")
            bundle = export(source, Path(work) / "bundle").path
        if openai_port == 0:  # one port for every instance: chosen here
            openai_port = free_port(host if host not in ("0.0.0.0", "") else "127.0.0.1")
        repo = write_repository(bundle, Path(work) / "repository", model_name=model_name, instances=instances,
                                batching=batching, backend=backend,
                                openai_port=openai_port, openai_host=host)
        name = repository_model(repo)
        server = TritonServer(repo, host, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port,
                              env={API_KEY_ENV: api_key} if api_key else {})

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
            if openai_port is not None:
                key = " (API key required)" if api_key else ""
                echo(f"  OpenAI  http://{server.client_host}:{openai_port}/v1{key}  (/models, /chat/completions, "
                     "/completions, /embeddings)")
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
