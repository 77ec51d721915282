"""Run NVIDIA Triton Inference Server on this machine: the server binary that ships in the nvidia-pytriton wheel.

    with TritonServer(repo, http_port=0) as server:     # 0: a free port
        print(server.url("/v2/health/ready"))

The wheel holds tritonserver, its Python backend and one backend stub per
Python version; the stub for this interpreter is linked into a backend
directory of our own (nothing is copied), and the stub is pointed at this
interpreter's libpython and site-packages, so the model imports the kvforge
installed here. stop() (and SIGTERM or Ctrl-C under `kvforge serve`) shuts the
server down cleanly; a server that does not go within its exit timeout is
killed, and the shared-memory regions its stubs held are removed.

A watchdog follows the server's backend stubs: a stub that dies (a crash, a
NumPy the stub was not built for) leaves Triton answering nothing for that
model, so the watchdog stops the whole server at once, records why (`failure`),
and a client waiting on it gets a closed connection instead of a long stall.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import NamedTuple

from kvforge.errors import KvforgeError, MissingDependencyError

INSTALL = "Install the serve extra: `pip install -e '.[serve]'` (nvidia-pytriton and tritonclient; Linux x86-64, glibc 2.35+)."


def triton_distribution() -> Path:
    """The tritonserver directory inside the nvidia-pytriton wheel."""
    try:
        import pytriton
    except ImportError as e:
        raise MissingDependencyError("Triton Inference Server (the nvidia-pytriton package)", INSTALL) from e
    root = Path(pytriton.__file__).resolve().parent / "tritonserver"
    if not (root / "bin" / "tritonserver").is_file():
        raise MissingDependencyError(f"the tritonserver binary (not in {root})", INSTALL)
    return root


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Process(NamedTuple):
    pid: int
    name: str
    state: str  # R, S, Z (dead, not yet reaped), ...
    ppid: int
    pgrp: int


def process_table() -> list[Process]:
    """Every process /proc shows (Linux), from each one's stat line."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        rest = stat[stat.rindex(")") + 2:].split()  # state, ppid, pgrp, ...
        found.append(Process(int(entry.name), stat[stat.index("(") + 1:stat.rindex(")")], rest[0], int(rest[1]), int(rest[2])))
    return found


class TritonServer:
    """A tritonserver process over a model repository; a context manager that waits until it is ready."""

    def __init__(self, repository: str | os.PathLike, host: str = "127.0.0.1", *, http_port: int = 8000,
                 grpc_port: int = 8001, metrics_port: int = 8002, exit_timeout_s: int = 10, log_file: str | None = None,
                 verbose: bool = False, dist: Path | None = None, watchdog: bool = True,
                 env: dict[str, str] | None = None):
        self.repository = Path(repository).resolve()
        self.host = host
        self.http_port = http_port or free_port(host)
        self.grpc_port = grpc_port or free_port(host)
        self.metrics_port = metrics_port or free_port(host)
        self.exit_timeout_s = exit_timeout_s
        self.verbose = verbose
        self.dist = dist or triton_distribution()
        self.work = Path(tempfile.mkdtemp(prefix="kvforge-triton-"))
        self.log_path = Path(log_file) if log_file else self.work / "tritonserver.log"
        self.shm_prefix = f"kvforge{os.getpid()}_{self.work.name[-8:]}_"
        self.proc: subprocess.Popen | None = None
        self._saved_log = ""
        self.watchdog = watchdog
        self.extra_env = dict(env or {})  # for the models' processes (the OpenAI front's API key)
        self.failure: str | None = None  # what the watchdog saw, when it stopped the server
        self._stopping = threading.Event()

    # -- set-up ------------------------------------------------------------------------
    def _backends(self) -> Path:
        version = f"{sys.version_info[0]}.{sys.version_info[1]}"
        stub = self.dist / "python_backend_stubs" / version / "triton_python_backend_stub"
        if not stub.is_file():
            have = sorted(p.name for p in (self.dist / "python_backend_stubs").iterdir())
            raise KvforgeError(f"nvidia-pytriton has no Python backend stub for Python {version} (it has {', '.join(have)})")
        python = self.work / "backends" / "python"
        python.mkdir(parents=True)
        for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
            (python / name).symlink_to(self.dist / "backends" / "python" / name)
        (python / "triton_python_backend_stub").symlink_to(stub)
        return python.parent

    def _env(self) -> dict[str, str]:
        env = os.environ.copy()
        # the stub embeds Python: it must load this interpreter's libpython (not another one on the system) and
        # find this interpreter's prefix (through `python3` on PATH) to import what is installed here
        libs = [sysconfig.get_config_var("LIBDIR") or "", str(self.dist.parent.parent / "nvidia_pytriton.libs")]
        env["LD_LIBRARY_PATH"] = ":".join(p for p in [*libs, env.get("LD_LIBRARY_PATH", "")] if p)
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env.update(self.extra_env)
        return env

    def command(self, backends: Path) -> list[str]:
        return [
            str(self.dist / "bin" / "tritonserver"), f"--model-repository={self.repository}",
            f"--backend-directory={backends}",
            f"--http-address={self.host}", f"--http-port={self.http_port}",
            f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}",
            "--allow-gpu-metrics=false", f"--exit-timeout-secs={self.exit_timeout_s}",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            "--log-verbose=0",
        ]

    # -- lifecycle ---------------------------------------------------------------------
    def start(self, timeout_s: float = 180) -> TritonServer:
        if not self.repository.is_dir():
            raise KvforgeError(f"{self.repository} is not a model repository directory (write one with `kvforge triton`)")
        log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.command(self._backends()), env=self._env(), stdout=None if self.verbose else log,
                                     stderr=subprocess.STDOUT if not self.verbose else None, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._cleanup()
                raise KvforgeError(f"tritonserver exited ({self.proc.returncode}) before it was ready:\n{self.log_tail()}")
            if self.ready():
                if self.watchdog:
                    threading.Thread(target=self._watch, name="kvforge-triton-watchdog", daemon=True).start()
                return self
            time.sleep(0.1)
        self.stop()
        raise KvforgeError(f"tritonserver was not ready within {timeout_s:.0f} s:\n{self.log_tail()}")

    def stubs(self) -> dict[int, str]:
        """The server's Python-backend stub processes: pid -> state letter (Z: dead, not yet reaped)."""
        if self.proc is None:
            return {}
        return {p.pid: p.state for p in process_table() if p.pgrp == self.proc.pid and p.name.startswith("triton_python")}

    def _watch(self, interval_s: float = 0.25) -> None:
        """Stop the server as soon as one of its stubs dies or goes (Triton leaves requests to that model hanging)."""
        seen = set(self.stubs())
        while not self._stopping.wait(interval_s):
            if self.proc is None or self.proc.poll() is not None:
                return
            stubs = self.stubs()
            dead = [pid for pid, state in stubs.items() if state in "ZX"] + sorted(seen - set(stubs))
            if dead:
                self.failure = f"a Python backend stub (pid {dead[0]}) died; the server was stopped"
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                return
            seen |= set(stubs)

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url("/v2/health/ready"), timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    @property
    def client_host(self) -> str:
        """Where a client on this machine reaches the server (listening on every interface: the loopback)."""
        return "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host

    def url(self, path: str = "") -> str:
        return f"http://{self.client_host}:{self.http_port}{path}"

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "\n".join(self._saved_log.splitlines()[-lines:]) or "(no log)"

    def wait(self) -> int:
        return self.proc.wait() if self.proc else 0

    def stop(self) -> int | None:
        """SIGTERM, then (past the exit timeout and a grace period) SIGKILL; leftovers removed. Returns the exit code."""
        code = None
        self._stopping.set()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(self.exit_timeout_s + 15)
            except subprocess.TimeoutExpired:
                self.proc.kill()  # the server only: its stubs notice, exit and free their shared memory
                code = self.proc.wait()
        elif self.proc is not None:
            code = self.proc.returncode
        self._cleanup()
        return code

    def _cleanup(self) -> None:
        if not self.work.exists():  # done already (stop() after a failed start, or a second stop())
            return
        if self.proc is not None:
            time.sleep(0.3)
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # stubs still alive after the server: none, normally
            except (ProcessLookupError, PermissionError):
                pass
        shm = Path("/dev/shm")
        if shm.is_dir():
            for leftover in shm.glob(f"{self.shm_prefix}*"):
                leftover.unlink(missing_ok=True)
        self._saved_log = self.log_tail(200)  # the log goes with the work directory (unless log_file named one)
        shutil.rmtree(self.work, ignore_errors=True)

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
