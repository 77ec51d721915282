"""`kvforge serve` refuses a Triton whose Python backend cannot take this NumPy; a server whose stub dies stops at once.

The broken pair is simulated the way it breaks: a copy of the nvidia-pytriton layout (links to the real
server binary, stubs and libraries) whose backend utilities' deserialize_bytes_tensor raises what the NumPy-1
stub under NumPy 2 makes it raise. The real server runs over it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvforge.errors import KvforgeError, MissingDependencyError

try:
    from kvforge.serving import TritonServer, check_python_backend, triton_distribution

    triton_distribution()
    _ABSENT = None
except MissingDependencyError as e:
    _ABSENT = str(e)
pytestmark = pytest.mark.skipif(_ABSENT is not None, reason=f"needs the serve extra: {_ABSENT}")

BROKEN = '''

def deserialize_bytes_tensor(encoded_tensor):  # what the NumPy-1 stub under NumPy 2 ends in
    raise struct.error("unpack_from requires a buffer of at least 286331157 bytes for unpacking 286331153 bytes "
                       "at offset 4 (actual buffer size is %d)" % len(encoded_tensor))
'''


def _broken_site(root: Path) -> Path:
    """site-packages-like folder holding a `pytriton` whose tritonserver/ mirrors the real one, utilities broken."""
    real = triton_distribution()
    site = root / "site"
    dist = site / "pytriton" / "tritonserver"
    (dist / "backends" / "python").mkdir(parents=True)
    (site / "pytriton" / "__init__.py").write_text("")
    for name in ("bin", "lib", "python_backend_stubs", "caches", "repoagents"):
        if (real / name).exists():
            (dist / name).symlink_to(real / name)
    for item in (real / "backends").iterdir():
        if item.name != "python":
            (dist / "backends" / item.name).symlink_to(item)
    (dist / "backends" / "python" / "libtriton_python.so").symlink_to(real / "backends" / "python" / "libtriton_python.so")
    utils = (real / "backends" / "python" / "triton_python_backend_utils.py").read_text()
    (dist / "backends" / "python" / "triton_python_backend_utils.py").write_text(utils + BROKEN)
    libs = real.parent.parent / "nvidia_pytriton.libs"
    if libs.exists():
        (site / "nvidia_pytriton.libs").symlink_to(libs)
    return site


def test_the_real_backend_round_trips_bytes(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFORGE_CACHE", str(tmp_path / "cache"))
    check_python_backend()  # raises on a broken pair: this environment's pair must be a working one
    marks = list((tmp_path / "cache" / "triton-preflight").glob("*.ok"))
    assert len(marks) == 1 and json.loads(marks[0].read_text())["numpy"].split(".")[0] == "1"


def test_a_broken_backend_is_refused_with_the_versions_and_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFORGE_CACHE", str(tmp_path / "cache"))
    dist = _broken_site(tmp_path) / "pytriton" / "tritonserver"
    with pytest.raises(KvforgeError) as caught:
        check_python_backend(dist=dist, timeout_s=30)
    message = str(caught.value)
    assert "unpack_from requires a buffer" in message and "numpy " in message and "nvidia-pytriton " in message
    assert "numpy<2" in message
    assert not list((tmp_path / "cache").rglob("*.ok"))  # a failed check is not remembered


def test_kvforge_serve_refuses_a_broken_backend_instead_of_hanging(tmp_path, tiny_fp32):
    site = _broken_site(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
           "KVFORGE_CACHE": str(tmp_path / "cache")}
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "kvforge", "serve", str(tiny_fp32.path), "--http-port", "0",
                          "--grpc-port", "0", "--metrics-port", "0"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert lines[0].startswith("error: Triton's Python backend cannot pass a BYTES tensor"), out.stderr
    assert "Traceback" not in out.stderr and "serving" not in out.stdout
    assert time.monotonic() - started < 90


def test_a_dying_stub_stops_the_server_and_the_waiting_client_is_not_left_hanging(tmp_path):
    model = tmp_path / "repo" / "dies"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text('name: "dies"\nbackend: "python"\nmax_batch_size: 0\n'
                                        'model_transaction_policy { decoupled: true }\n'
                                        'input [ { name: "IN" data_type: TYPE_STRING dims: [ -1 ] } ]\n'
                                        'output [ { name: "OUT" data_type: TYPE_STRING dims: [ -1 ] } ]\n')
    (model / "1" / "model.py").write_text("import os, signal\n\n\nclass TritonPythonModel:\n"
                                          "    def execute(self, requests):\n        os.kill(os.getpid(), signal.SIGKILL)\n")
    with TritonServer(model.parent, http_port=0, grpc_port=0, metrics_port=0) as server:
        assert server.stubs() and all(state not in "ZX" for state in server.stubs().values())
        request = urllib.request.Request(server.url("/v2/models/dies/generate"), data=json.dumps({"IN": "x"}).encode())
        started = time.monotonic()
        with pytest.raises((urllib.error.URLError, OSError)):
            urllib.request.urlopen(request, timeout=60).read()
        assert time.monotonic() - started < 20  # the watchdog's doing, not the client's 60 s timeout
        deadline = time.monotonic() + 10
        while server.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.proc.poll() is not None and "stub" in (server.failure or "")
