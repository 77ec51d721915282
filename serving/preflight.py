"""Before serving: can this Triton's Python backend hand a model a BYTES tensor with the NumPy installed here?

Every nvidia-pytriton wheel so far carries a Python-backend stub compiled against
NumPy 1. Under NumPy 2 the stub passes garbage to `deserialize_bytes_tensor` for
every BYTES input ("unpack_from requires a buffer of at least 286331157 bytes ...
actual buffer size is 21"): the server starts and reports ready, then fails or
hangs on the first request. Nothing short of running the stub tells a working pair
from a broken one (the utilities module is pure Python and round-trips fine on its
own), so the check does what a request does: it starts the server over a one-model
repository whose Python model echoes a BYTES tensor, sends one request and compares
the answer. That takes about five seconds; a pair that passed is remembered under
$KVFORGE_CACHE, keyed by the versions and by the stub and utilities files
themselves, so the check runs once per installed set.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
import urllib.error
import urllib.request
from importlib import metadata
from pathlib import Path

from kvforge.cache import cache_dir
from kvforge.errors import KvforgeError

from .server import TritonServer, triton_distribution

PROBE = "kvforge_bytes_probe"
CONFIG = f'''name: "{PROBE}"
backend: "python"
max_batch_size: 0
input [ {{ name: "IN" data_type: TYPE_STRING dims: [ -1 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_STRING dims: [ -1 ] }} ]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
'''
MODEL = '''import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy().reshape(-1)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array(list(values), dtype=np.object_))]))
        return responses
'''
# lengths that cover the 4-byte length prefix's bytes, an empty string and non-ASCII UTF-8
SAMPLE = ["kvforge", "", "déjà vu ✓", "x" * 300]
FIX = ("install the serve extra's pair: `pip install 'nvidia-pytriton>=0.7' 'numpy<2'` "
       "(or `pip install -e '.[serve]'` in a fresh environment)")


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def versions() -> dict[str, str]:
    import numpy

    return {"nvidia-pytriton": _version("nvidia-pytriton"), "numpy": numpy.__version__,
            "python": f"{sys.version_info[0]}.{sys.version_info[1]}"}


def _fingerprint(dist: Path) -> str:
    """Versions, plus the backend files the check exercises (a replaced utilities module or stub is a new pair)."""
    digest = hashlib.sha256(json.dumps(versions(), sort_keys=True).encode())
    python = f"{sys.version_info[0]}.{sys.version_info[1]}"
    for path in (dist / "backends" / "python" / "triton_python_backend_utils.py",
                 dist / "python_backend_stubs" / python / "triton_python_backend_stub"):
        try:
            stat = path.stat()
            digest.update(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
        except OSError:
            digest.update(f"{path}:missing".encode())
    return digest.hexdigest()[:24]


def _round_trip(dist: Path, timeout_s: float) -> str | None:
    """None when the echo model gave SAMPLE back; otherwise what went wrong (the server's words where it had any)."""
    with tempfile.TemporaryDirectory(prefix="kvforge-preflight-") as work:
        model = Path(work) / PROBE
        (model / "1").mkdir(parents=True)
        (model / "config.pbtxt").write_text(CONFIG)
        (model / "1" / "model.py").write_text(MODEL)
        server = TritonServer(work, http_port=0, grpc_port=0, metrics_port=0, exit_timeout_s=2, dist=dist)
        try:
            server.start(timeout_s=timeout_s)
        except KvforgeError as e:
            return f"the server did not start: {e}"
        try:
            body = {"inputs": [{"name": "IN", "shape": [len(SAMPLE)], "datatype": "BYTES", "data": SAMPLE}]}
            request = urllib.request.Request(server.url(f"/v2/models/{PROBE}/infer"), data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=timeout_s) as r:
                    answer = json.loads(r.read())
            except urllib.error.HTTPError as e:
                detail = e.read().decode(errors="replace")
                try:
                    detail = json.loads(detail).get("error", detail)
                except ValueError:
                    pass
                return " ".join(str(detail).split())[:400]
            except (urllib.error.URLError, OSError) as e:  # a dead stub, a hung request
                return f"no answer within {timeout_s:.0f} s ({e}); server log:\n{server.log_tail(10)}"
            got = next((o.get("data") for o in answer.get("outputs", []) if o.get("name") == "OUT"), None)
            return None if got == SAMPLE else f"the model got {got!r} for {SAMPLE!r}"
        finally:
            server.stop()


def check_python_backend(timeout_s: float = 60, dist: Path | None = None) -> None:
    """Raise KvforgeError naming the versions and the fix when the backend cannot round-trip a BYTES tensor."""
    dist = dist or triton_distribution()
    mark = cache_dir("triton-preflight") / f"{_fingerprint(dist)}.ok"
    if mark.is_file():
        return
    problem = _round_trip(dist, timeout_s)
    if problem is not None:
        have = ", ".join(f"{k} {v}" for k, v in versions().items())
        raise KvforgeError(f"Triton's Python backend cannot pass a BYTES tensor to a model here ({have}): {problem}. "
                           f"Every nvidia-pytriton stub so far is built for NumPy 1; {FIX}")
    try:
        mark.write_text(json.dumps(versions()) + "\n")
    except OSError:
        pass  # no cache: the check simply runs again next time
