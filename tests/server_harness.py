"""Running the real `h3gen serve` in a subprocess on 127.0.0.1 for tests, and talking to it over HTTP."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """`h3gen serve` with the tiny model; `.url`, `.client()`, `.stop()`, `.kill()`. Logs go to `log_path`."""

    def __init__(self, model: Path, results_dir: Path, *, max_queue: int = 16, api_key: str | None = None,
                 cache: Path | None = None, extra: tuple[str, ...] = (), ui: bool = False, port: int | None = None,
                 env: dict | None = None, ready_timeout: float = 90.0):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = Path(results_dir).parent / f"server-{self.port}.log"
        args = [sys.executable, "-m", "h3gen.cli", "serve", "--model", str(model), "--port", str(self.port),
                "--results-dir", str(results_dir), "--max-queue", str(max_queue), "--device", "cpu",
                "--log-level", "warning", *extra]
        if api_key:
            args += ["--api-key", api_key]
        if not ui:
            args.append("--no-ui")
        env = dict(os.environ, HF_HUB_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False", **(env or {}))
        if cache:
            env["H3GEN_CACHE"] = str(cache)
        self._log = open(self.log_path, "w")
        # Its own process group, so stopping it also reaches any ranks it started under torchrun.
        self.process = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)
        self._wait_ready(ready_timeout)

    def _wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).json().get("ready"):
                    return
            except httpx.HTTPError:
                pass
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
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()


def cancelled(view: dict) -> bool:
    """Whether a `Video` object is a cancelled job (OpenAI's API shows it as failed with error code "cancelled")."""
    return view["status"] == "failed" and (view.get("error") or {}).get("code") == "cancelled"


def wait_for(client: httpx.Client, job_id: str, statuses=("completed", "failed"), timeout=120.0,
             predicate=None) -> dict:
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
