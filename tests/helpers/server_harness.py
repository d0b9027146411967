"""Running the real `h3gen serve` in a subprocess on 127.0.0.1 for tests, and talking to it over HTTP.

Every process started here runs in a process group of its own and is recorded in `STARTED`: a server that fails to
become ready is killed before the error is raised, and `tests/conftest.py` kills whatever a test (or, at the end of
the session, a fixture) left running, so a failed test leaves no `h3gen` process behind.
"""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

STARTED: list[subprocess.Popen] = []  # every process group started here, in order


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL `process` and everything in its process group (torchrun's ranks), then reap it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


def run_isolated(args: list[str], *, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run(args, capture_output=True, text=True)` in a process group of its own, killed whole when it
    times out or the test is interrupted (a plain `subprocess.run` kills only its child, not torchrun's ranks)."""
    process = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kwargs
    )
    STARTED.append(process)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except BaseException:
        kill_group(process)
        raise
    finally:
        STARTED.remove(process)
    return subprocess.CompletedProcess(args, process.returncode, stdout, stderr)


def memory_kb(pid: int, field: str = "VmRSS") -> int:
    """A process's memory from /proc in KB: `VmRSS` (resident now) or `VmHWM` (the resident peak)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for process {pid}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """`h3gen serve` with the tiny model; `.url`, `.client()`, `.stop()`, `.kill()`. Logs go to `log_path`."""

    def __init__(
        self,
        model: Path,
        results_dir: Path,
        *,
        max_queue: int = 16,
        api_key: str | None = None,
        cache: Path | None = None,
        extra: tuple[str, ...] = (),
        ui: bool = False,
        port: int | None = None,
        env: dict | None = None,
        ready_timeout: float = 90.0,
    ):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = Path(results_dir).parent / f"server-{self.port}.log"
        args = [
            sys.executable,
            "-m",
            "h3gen.cli",
            "serve",
            "--model",
            str(model),
            "--port",
            str(self.port),
            "--results-dir",
            str(results_dir),
            "--max-queue",
            str(max_queue),
            "--device",
            "cpu",
            "--log-level",
            "warning",
            *extra,
        ]
        if api_key:
            args.append(f"--api-key={api_key}")  # one argument, whatever the key begins with
        if not ui:
            args.append("--no-ui")
        env = dict(os.environ, HF_HUB_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False", **(env or {}))
        if cache:
            env["H3GEN_CACHE"] = str(cache)
        self._log = open(self.log_path, "w")
        # Its own process group, so stopping it also reaches any ranks it started under torchrun.
        self.process = subprocess.Popen(
            args, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        STARTED.append(self.process)
        try:
            self._wait_ready(ready_timeout)
        except BaseException:
            self.kill()
            raise

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_ready(self, timeout: float = 90.0) -> None:
        """Return once /health says ready; raise at once when the server exits or reports a load error."""
        deadline = time.monotonic() + timeout
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log_path.read_text()[-3000:]}")
            try:
                health = httpx.get(f"{self.url}/health", headers=headers, timeout=2).json()
            except (httpx.HTTPError, ValueError):
                health = {}
            if health.get("ready"):
                return
            if health.get("load_error"):
                raise RuntimeError(
                    f"server could not load its model ({health['load_error']}):\n{self.log_path.read_text()[-3000:]}"
                )
            time.sleep(0.2)
        raise RuntimeError(f"server not ready in {timeout} s:\n{self.log_path.read_text()[-3000:]}")

    def client(self, **kwargs) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30, **kwargs)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                pass
        self._kill_group()
        self._log.close()

    def kill(self) -> None:
        """Die the way a crash or power cut would: no shutdown code runs."""
        self._kill_group()
        self._log.close()

    def _kill_group(self) -> None:
        kill_group(self.process)
        if self.process in STARTED:
            STARTED.remove(self.process)


def cancelled(view: dict) -> bool:
    """Whether a `Video` object is a cancelled job (OpenAI's API shows it as failed with error code "cancelled")."""
    return view["status"] == "failed" and (view.get("error") or {}).get("code") == "cancelled"


def wait_for(
    client: httpx.Client, job_id: str, statuses=("completed", "failed"), timeout=120.0, predicate=None
) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        view = client.get(f"/v1/videos/{job_id}").json()
        if view["status"] in statuses and (predicate is None or predicate(view)):
            return view
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} did not reach {statuses}: {view}")


def wait_loaded(engine, timeout: float) -> bool:
    """Wait until an in-process engine has loaded its model or failed to: True when it did within `timeout`."""
    deadline = time.monotonic() + timeout
    while not (engine.ready or engine.load_error):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def done_running_queued(http: httpx.Client, fast: dict, long: dict) -> tuple[str, str, str]:
    """Three jobs on a server: one finished, one running (long), one queued behind it; their ids."""
    done = http.post("/v1/videos", json={"prompt": "kept", **fast}).json()["id"]
    wait_for(http, done)
    running = http.post("/v1/videos", json={"prompt": "interrupted", **long}).json()["id"]
    queued = http.post("/v1/videos", json={"prompt": "requeued", **fast}).json()["id"]
    wait_for(http, running, statuses=("in_progress",))
    return done, running, queued


class Worker:
    """`h3gen worker` with the tiny model on `store`, in a process group of its own; `.kill()` dies like a lost
    machine, `.stop()` drains with SIGTERM. Logs go to `<results>/../worker-<name>.log`."""

    def __init__(self, model: Path, store: str, results_dir: Path, name: str, *, extra: tuple[str, ...] = ()):
        self.name = name
        self.log_path = Path(results_dir).parent / f"worker-{name}.log"
        args = [sys.executable, "-m", "h3gen.cli", "worker", "--store", store, "--results-dir", str(results_dir)]
        args += ["--model", str(model), "--device", "cpu", "--name", name, *extra]
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            args, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        STARTED.append(self.process)

    def stop(self, timeout: float = 60.0) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        kill_group(self.process)
        if self.process in STARTED:
            STARTED.remove(self.process)
        self._log.close()


def live_workers(http: httpx.Client) -> list[dict]:
    """The live workers an API node reports in /health."""
    return http.get("/health").json().get("workers") or []
