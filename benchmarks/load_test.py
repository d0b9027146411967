"""Load test of `h3gen serve` over its REST API, on 127.0.0.1 only.

Starts `h3gen serve` (the tiny demo model unless `--model`, `--max-queue 10`, a random `--api-key`) in a temporary
results folder, or targets a running one with `--url` and `--api-key`. After one warm-up job it runs two phases:

- burst: `--burst` clients (50) each submit one job at the same moment; the accepted jobs are followed to the end.
- sustained: `--clients` clients (16) for `--sustain-seconds` (180) each submit a job (every fourth a multipart
  fl2va with a small PNG keyframe), poll its status, cancel about one in five, download the MP4 of the others and
  list the jobs; a 429 waits out `Retry-After` (at most 2 s). Jobs accepted before the end are followed until they
  finish (at most `--drain-seconds`).

- hostile: with `--hostile N` (default 0), N more clients run beside the sustained ones for the same time, each in
  turn sending a 300 MB Content-Length with and without the key (answered from the headers: 413 / 401), a JSON body
  past its limit (413), JSON nested 50,000 deep as a body and inside a form field (422), a million tiny JSON values
  (422), a 16 KB WAV at 4001 Hz as a ref2va sound (accepted, and followed like any job) and a 160 KB PNG of
  13,000 x 13,000 pixels (422). Meanwhile /health is asked every 0.1 s; its p50 / p99 latency is reported.

Every call carries the API key (but the one hostile call that tests a missing key). A job is lost when it was
accepted and then did not finish (within the drain time), failed, was cancelled without being asked to, or its MP4
is missing or not an MP4; every `--decode-every`-th MP4 is decoded in full with PyAV (all frames, both audio
channels). Prints per phase: accepted / 429 / 5xx / other 4xx / transport errors / lost / p50 and p95 status-poll
latency, then the server's resident memory (VmRSS of the server process and its children) and open file descriptors
after the warm-up, at the peak and at the end. Exits 1 on any 5xx, transport error, lost job, hostile call answered
otherwise than expected, /health p99 over 100 ms during a hostile run, or a server that is gone at the end.

    python benchmarks/load_test.py [--sustain-seconds 180] [--clients 16] [--burst 50] [--hostile 4] [--json out.json]
    python benchmarks/load_test.py --url http://127.0.0.1:8000 --api-key "$KEY" [--pid SERVER_PID]
"""

import argparse
import asyncio
import io
import ipaddress
import json
import os
import random
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import av
import httpx
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "tests"))  # the test helpers that write media files
from common import print_table
from helpers.media_files import bomb_png, wav_bytes

FINISHED = ("completed", "failed")  # OpenAI's statuses; a cancelled job is failed with error.code "cancelled"
MAX_CLIENTS = 200  # bounds on what one run may open, whatever the flags say
MAX_SECONDS = 3600
REQUEST_TIMEOUT = 30.0
HEALTH_P99_MS = 100.0  # /health must answer this fast while hostile requests are handled


# ---------------------------------------------------------------------------------------------- the server


def loopback_url(url: str) -> str:
    """`url` without a trailing slash if its host is a loopback address (127.0.0.0/8, ::1, or a name that resolves
    only to those); raises ValueError otherwise."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--url must look like http://127.0.0.1:8000 (got {url!r})")
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(parts.hostname, parts.port or 80)}
    except socket.gaierror as error:
        raise ValueError(f"--url host {parts.hostname!r} does not resolve: {error}") from None
    if not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
        raise ValueError(f"--url must be a loopback address; {parts.hostname!r} resolves to {sorted(addresses)}")
    return url.rstrip("/")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LocalServer:
    """`h3gen serve` in its own process group on 127.0.0.1 with a fresh results folder; `.url`, `.pid`, `.stop()`."""

    def __init__(
        self,
        workdir: Path,
        *,
        api_key: str,
        max_queue: int,
        model: str | None,
        device: str | None,
        ui: bool,
        workers: int = 1,
        ready_timeout: float = 180.0,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "server.log"
        args = [
            sys.executable,
            "-m",
            "h3gen.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--results-dir",
            str(workdir / "results"),
            "--max-queue",
            str(max_queue),
            f"--api-key={api_key}",  # one argument: a random key may begin with "-"
            "--log-level",
            "warning",
        ]
        args += ["--model", model] if model else []
        args += ["--device", device] if device else []
        args += [] if ui else ["--no-ui"]
        args += ["--workers", str(workers)]
        env = dict(os.environ, HF_HUB_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False")
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            args, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        self.pid = self.process.pid
        try:
            wait_ready(self.url, api_key, ready_timeout, alive=lambda: self.process.poll() is None)
        except RuntimeError as error:
            self.stop()
            raise RuntimeError(f"{error}\n{self.log_tail()}") from None

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.pid, signal.SIGKILL)  # whatever of its group is left
        except ProcessLookupError:
            pass
        self.process.wait()
        self._log.close()


def wait_ready(url: str, api_key: str, timeout: float, alive=lambda: True) -> None:
    """Until `GET /health` answers 200 and does not say `ready: false`."""
    deadline = time.monotonic() + timeout
    headers = {"Authorization": f"Bearer {api_key}"}
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError("the server exited before it was ready")
        try:
            response = httpx.get(f"{url}/health", headers=headers, timeout=2)
            if response.status_code == 200 and response.json().get("ready", True):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.25)
    raise RuntimeError(f"the server at {url} was not ready within {timeout:.0f} s")


# ---------------------------------------------------------------------------------------------- /proc


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(f"/proc/{entry.name}/stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:  # field 4, after the parenthesised command name
                found.append(int(entry.name))
    return found


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants."""
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo += _children(current)
    return tree


def tree_usage(pid: int) -> tuple[float, int] | None:
    """(VmRSS in MiB, open file descriptors) summed over `pid` and its descendants; None when `pid` is gone."""
    rss_kib, fds, seen = 0, 0, False
    for member in process_tree(pid):
        try:
            status = Path(f"/proc/{member}/status").read_text()
            fds += len(os.listdir(f"/proc/{member}/fd"))
        except OSError:
            continue
        seen = True
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                rss_kib += int(line.split()[1])
    return (rss_kib / 1024, fds) if seen else None


def listening_pid(port: int) -> int | None:
    """The process that holds a listening TCP socket on `port`, from /proc/net/tcp{,6} and /proc/*/fd."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if int(cols[1].rpartition(":")[2], 16) == port and cols[3] == "0A":  # 0A: LISTEN
                inodes.add(f"socket:[{cols[9]}]")
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            for fd in os.scandir(f"/proc/{entry.name}/fd"):
                if os.readlink(fd.path) in inodes:
                    return int(entry.name)
        except OSError:
            continue
    return None


class Usage:
    """Samples the server tree's memory and descriptors every `interval` s in a thread, keeping the peak."""

    def __init__(self, pid: int | None, interval: float = 1.0):
        self.pid, self.interval = pid, interval
        self.peak_rss = 0.0
        self.peak_fds = 0

    def now(self) -> tuple[float, int] | None:
        usage = tree_usage(self.pid) if self.pid else None
        if usage:
            self.peak_rss, self.peak_fds = max(self.peak_rss, usage[0]), max(self.peak_fds, usage[1])
        return usage

    async def sample(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.to_thread(self.now)
            try:
                await asyncio.wait_for(stop.wait(), self.interval)
            except asyncio.TimeoutError:
                pass


# ---------------------------------------------------------------------------------------------- MP4 check


def decode_mp4(data: bytes) -> dict:
    """Decode every video and audio frame of an MP4 held in memory with PyAV; raises on a broken file.
    Returns {"frames", "width", "height", "audio_channels", "sample_rate", "audio_samples"}."""
    frames, samples, width, height, channels, rate = 0, 0, 0, 0, 0, 0
    with av.open(io.BytesIO(data), mode="r") as container:
        if not container.streams.video or not container.streams.audio:
            raise ValueError("the MP4 lacks a video or an audio stream")
        for frame in container.decode(video=0, audio=0):
            if isinstance(frame, av.VideoFrame):
                frames += 1
                width, height = frame.width, frame.height
            else:
                samples += frame.samples
                channels, rate = len(frame.layout.channels), frame.sample_rate
    return {
        "frames": frames,
        "width": width,
        "height": height,
        "audio_channels": channels,
        "sample_rate": rate,
        "audio_samples": samples,
    }


def mp4_problem(data: bytes, request: dict, decode: bool) -> str | None:
    """Why `data` is not the MP4 `request` (a job's normalized request) asked for, or None. Without `decode` only
    the container's first box is checked."""
    if len(data) < 1024 or data[4:8] != b"ftyp":
        return f"not an MP4 ({len(data)} bytes)"
    if not decode:
        return None
    try:
        info = decode_mp4(data)
    except (av.error.FFmpegError, ValueError) as error:
        return f"does not decode: {error}"
    expected = (request.get("num_frames"), request.get("width"), request.get("height"))
    got = (info["frames"], info["width"], info["height"])
    if None not in expected and got != expected:
        return f"{got[0]} frames of {got[1]}x{got[2]}, expected {expected[0]} of {expected[1]}x{expected[2]}"
    if info["audio_channels"] != 2 or info["sample_rate"] != request.get("audio_sample_rate", info["sample_rate"]):
        return f"audio is {info['audio_channels']} channels at {info['sample_rate']} Hz"
    return None


def keyframe_png(seed: int) -> bytes:
    """A small solid-colour PNG for fl2va jobs."""
    rng = random.Random(seed)
    buffer = io.BytesIO()
    Image.new("RGB", (96, 64), tuple(rng.randrange(256) for _ in range(3))).save(buffer, "PNG")
    return buffer.getvalue()


# ---------------------------------------------------------------------------------------------- the clients


@dataclass
class Tally:
    """What one phase saw. `jobs` maps each accepted job to its fate: succeeded, cancelled (by us), deleted (we
    cancelled it as it finished, so it was deleted) or `lost: <why>`."""

    calls: int = 0
    statuses: Counter = field(default_factory=Counter)
    transport_errors: int = 0
    poll_ms: list[float] = field(default_factory=list)
    jobs: dict[str, str] = field(default_factory=dict)
    decoded: int = 0
    unexpected: int = 0  # hostile calls answered otherwise than expected
    notes: list[str] = field(default_factory=list)

    def note(self, text: str) -> None:
        if len(self.notes) < 20:
            self.notes.append(text)

    def row(self, phase: str) -> dict:
        fates = Counter(fate.partition(":")[0] for fate in self.jobs.values())
        five = sum(n for code, n in self.statuses.items() if code >= 500)
        other_4xx = sum(n for code, n in self.statuses.items() if 400 <= code < 500 and code != 429)
        p50, p95 = percentiles(self.poll_ms)
        return {
            "phase": phase,
            "calls": self.calls,
            "accepted": len(self.jobs),
            "429": self.statuses[429],
            "5xx": five,
            "other_4xx": other_4xx,
            "transport_err": self.transport_errors,
            "succeeded": fates["succeeded"],
            "cancelled": fates["cancelled"] + fates["deleted"],
            "lost": fates["lost"],
            "unexpected": self.unexpected,
            "mp4_decoded": self.decoded,
            "polls": len(self.poll_ms),
            "poll_p50_ms": f"{p50:.1f}",
            "poll_p95_ms": f"{p95:.1f}",
        }


def percentiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return (values[0], values[0]) if values else (float("nan"), float("nan"))
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return cuts[49], cuts[94]


class Run:
    """The shared settings of the clients and the tally they write to."""

    def __init__(self, url: str, api_key: str, options: argparse.Namespace, tally: Tally):
        self.url, self.api_key, self.options, self.tally = url, api_key, options, tally
        self.finished_jobs = 0

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.url, headers={"Authorization": f"Bearer {self.api_key}"}, timeout=REQUEST_TIMEOUT
        )

    async def call(self, http: httpx.AsyncClient, method: str, path: str, *, expect=(), **kwargs):
        """One request, counted by status; `expect` lists the 4xx codes that are a right answer here (they are not
        counted as errors). None on a transport error."""
        self.tally.calls += 1
        try:
            response = await http.request(method, path, **kwargs)
        except httpx.HTTPError as error:
            self.tally.transport_errors += 1
            self.tally.note(f"{method} {path}: {type(error).__name__}: {error}")
            return None
        if response.status_code >= 400 and response.status_code not in expect:
            self.tally.statuses[response.status_code] += 1
            if response.status_code != 429:
                self.tally.note(f"{method} {path} -> {response.status_code} {response.text[:200]}")
        return response

    def job_body(self, seed: int, multipart: bool, steps: int | None = None) -> dict:
        steps = steps or self.options.steps
        fields = {"prompt": f"load test {seed}", "seed": seed, "num_inference_steps": steps}
        if not multipart:
            return {"json": fields}
        return {
            "data": {**{k: str(v) for k, v in fields.items()}, "task": "fl2va"},
            "files": {"image": ("first.png", keyframe_png(seed), "image/png")},
        }

    async def submit(self, http: httpx.AsyncClient, seed: int, multipart: bool = False, steps: int | None = None):
        """The new job's id, or the 429's Retry-After in seconds (float), or None."""
        body = self.job_body(seed, multipart, steps)
        response = await self.call(http, "POST", "/v1/videos", expect=(429,), **body)
        if response is None:
            return None
        if response.status_code == 429:
            self.tally.statuses[429] += 1
            try:
                return float(response.headers.get("retry-after", "1"))
            except ValueError:
                return 1.0
        if response.status_code == 202:
            job_id = response.json()["id"]
            self.tally.jobs[job_id] = "lost: never seen finished"
            return job_id
        return None

    async def follow(self, http: httpx.AsyncClient, job_id: str, deadline: float, cancel_after: int | None = None):
        """Poll the job until it finishes (or `deadline`), cancelling it after `cancel_after` polls if asked, then
        check its result, and record its fate."""
        polls, cancelled, view = 0, False, None
        while time.monotonic() < deadline:
            started = time.perf_counter()
            response = await self.call(http, "GET", f"/v1/videos/{job_id}", expect=(404,) if cancelled else ())
            if response is not None:  # a transport error is counted as one, not as a latency
                self.tally.poll_ms.append((time.perf_counter() - started) * 1000)
            polls += 1
            if response is not None and response.status_code == 404 and cancelled:
                self.tally.jobs[job_id] = "deleted"  # it had finished when we cancelled it, so it was deleted
                return
            if response is not None and response.status_code == 200:
                view = response.json()
                if view["status"] in FINISHED:
                    break
                if cancel_after is not None and polls >= cancel_after and not cancelled:
                    answer = await self.call(http, "DELETE", f"/v1/videos/{job_id}")
                    cancelled = answer is not None and answer.status_code == 200
                    if cancelled and answer.json().get("deleted"):
                        self.tally.jobs[job_id] = "deleted"
                        return
            await asyncio.sleep(self.options.poll_interval * random.uniform(0.8, 1.2))
        else:
            self.tally.jobs[job_id] = f"lost: still {view and view['status']} when the drain time ran out"
            return
        self.tally.jobs[job_id] = await self.check_result(http, job_id, view, cancelled)

    async def check_result(self, http: httpx.AsyncClient, job_id: str, view: dict, cancelled: bool) -> str:
        status = view["status"]
        if status == "failed" and (view.get("error") or {}).get("code") == "cancelled":
            if not cancelled:
                return "lost: cancelled though nobody asked"
            response = await self.call(http, "GET", f"/v1/videos/{job_id}/content", expect=(410,))
            return "cancelled" if response is not None and response.status_code == 410 else "lost: content not 410"
        if status == "failed":
            return f"lost: failed: {view.get('error')}"
        response = await self.call(http, "GET", view.get("content_url") or f"/v1/videos/{job_id}/content")
        if response is None or response.status_code != 200:
            return f"lost: content answered {response and response.status_code}"
        self.finished_jobs += 1
        decode = (self.finished_jobs - 1) % self.options.decode_every == 0  # the first, then every n-th
        problem = await asyncio.to_thread(mp4_problem, response.content, view.get("request") or {}, decode)
        self.tally.decoded += decode
        return f"lost: MP4 {problem}" if problem else "succeeded"

    async def list_jobs(self, http: httpx.AsyncClient) -> None:
        """One page of the job list, and the next page when there is one."""
        response = await self.call(http, "GET", "/v1/videos", params={"limit": 20})
        if response is not None and response.status_code == 200:
            page = response.json()
            if page.get("has_more") and page.get("last_id"):
                await self.call(http, "GET", "/v1/videos", params={"limit": 20, "after": page["last_id"]})


async def burst(run: Run, clients: int, drain_seconds: float) -> None:
    """`clients` clients, each with its own connection, submit one job at the same moment; then the accepted jobs
    are followed to the end."""
    start = asyncio.Event()
    https = [run.client() for _ in range(clients)]

    async def one(http: httpx.AsyncClient, index: int):
        await start.wait()
        job = await run.submit(http, seed=index, steps=run.options.burst_steps)
        if isinstance(job, str):
            await run.follow(http, job, time.monotonic() + drain_seconds)

    try:
        tasks = [asyncio.create_task(one(http, i)) for i, http in enumerate(https)]
        await asyncio.sleep(0.2)  # every task waits on the start line
        start.set()
        await asyncio.gather(*tasks)
    finally:
        await asyncio.gather(*(http.aclose() for http in https))


async def sustained(run: Run, clients: int, seconds: float, drain_seconds: float) -> None:
    """`clients` clients for `seconds`: submit (every fourth multipart fl2va), poll, cancel about one in five,
    download, and list; each job accepted in time is followed for up to `drain_seconds` after the end."""
    stop_at = time.monotonic() + seconds
    drain_until = stop_at + drain_seconds

    async def one(index: int):
        rng = random.Random(index)
        async with run.client() as http:
            iteration = 0
            while time.monotonic() < stop_at:
                iteration += 1
                seed = index * 100_000 + iteration
                job = await run.submit(http, seed, multipart=iteration % 4 == 0)
                if isinstance(job, str):
                    cancel_after = rng.randint(1, 4) if rng.random() < run.options.cancel_fraction else None
                    await run.follow(http, job, drain_until, cancel_after)
                elif isinstance(job, float):
                    await asyncio.sleep(min(job, 2.0) * rng.uniform(0.5, 1.0))
                else:
                    await asyncio.sleep(0.5)
                if iteration % 3 == 0:
                    await run.list_jobs(http)

    await asyncio.gather(*(one(i) for i in range(clients)))


async def declared_only(url: str, path: str, api_key: str | None, length: int = 300_000_000) -> int | None:
    """POST `path` declaring a `length`-byte body and sending none of it: the status the server answers from the
    headers alone (None if it waits for the body or the connection fails)."""
    parts = urlsplit(url)
    try:
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port or 80)
    except OSError:
        return None
    key = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: {parts.hostname}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n{key}Connection: close\r\n\r\n".encode()
    )
    try:
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), REQUEST_TIMEOUT)
        return int(line.split()[1])
    except (OSError, asyncio.TimeoutError, IndexError, ValueError):
        return None
    finally:
        writer.close()


async def hostile(run: Run, clients: int, seconds: float, drain_seconds: float) -> None:
    """`clients` clients for `seconds`, each sending in turn the hostile requests of the module docstring; an
    answer other than the expected one is counted as `unexpected` (a 5xx also as 5xx); the accepted odd-rate job
    is followed to the end."""
    stop_at = time.monotonic() + seconds
    deep = b"[" * 50_000 + b"]" * 50_000
    many = b'{"prompt": "x", "cache": [' + b"0," * 1_000_000 + b"0]}"
    png = keyframe_png(1)
    with tempfile.TemporaryDirectory() as folder:
        bomb = bomb_png(Path(folder) / "bomb.png").read_bytes()
    cases = [
        ("declared 300 MB, no key", None, 401),
        ("declared 300 MB", None, 413),
        (
            "JSON past its limit",
            {"content": b'{"prompt": "' + b"x" * (9 * 2**20) + b'"}', "headers": {"content-type": "application/json"}},
            413,
        ),
        (
            "deep JSON body",
            {"content": b'{"prompt": ' + deep + b"}", "headers": {"content-type": "application/json"}},
            422,
        ),
        (
            "deep JSON in a form field",
            {"files": [("prompt", (None, "x")), ("quality", (None, "high")), ("cache", (None, deep.decode()))]},
            422,
        ),
        ("a million JSON values", {"content": many, "headers": {"content-type": "application/json"}}, 422),
        (
            "4001 Hz sound",
            {
                "data": {"prompt": "x", "task": "ref2va", "num_inference_steps": str(run.options.steps)},
                "files": [
                    ("ref_image", ("a.png", png, "image/png")),
                    ("ref_audio", ("a.wav", wav_bytes(4001, 8000), "audio/wav")),
                ],
            },
            202,
        ),
        (
            "13,000 x 13,000 PNG",
            {"data": {"prompt": "x", "task": "fl2va"}, "files": {"image": ("bomb.png", bomb, "image/png")}},
            422,
        ),
    ]

    async def one(index: int):
        async with run.client() as http:
            turn = index
            while time.monotonic() < stop_at:
                name, request, expected = cases[turn % len(cases)]
                turn += 1
                if request is None:
                    run.tally.calls += 1
                    status = await declared_only(run.url, "/v1/videos", None if expected == 401 else run.api_key)
                else:
                    response = await run.call(http, "POST", "/v1/videos", expect=(expected, 422, 413, 429), **request)
                    status = response.status_code if response is not None else None
                if status == 202:
                    job_id = response.json()["id"]
                    run.tally.jobs[job_id] = "lost: never seen finished"
                    await run.follow(http, job_id, stop_at + drain_seconds)
                elif status != expected and status != 429:
                    run.tally.unexpected += 1
                    run.tally.note(f"hostile {name}: answered {status}, expected {expected}")
                    if status is not None and status >= 500:
                        run.tally.statuses[status] += 1
                await asyncio.sleep(0.2)

    await asyncio.gather(*(one(i) for i in range(clients)))


async def health_probe(url: str, stop: asyncio.Event, latencies: list[float], interval: float = 0.1) -> None:
    """GET /health every `interval` s until `stop`, recording each answer's latency in ms."""
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT) as http:
        while not stop.is_set():
            started = time.perf_counter()
            try:
                await http.get(f"{url}/health")
                latencies.append((time.perf_counter() - started) * 1000)
            except httpx.HTTPError:
                latencies.append(REQUEST_TIMEOUT * 1000)
            await asyncio.sleep(interval)


async def warm_up(run: Run, timeout: float) -> None:
    """One job to the end, so that first-job allocations do not read as growth."""
    async with run.client() as http:
        job = await run.submit(http, seed=0)
        if not isinstance(job, str):
            raise RuntimeError(f"the warm-up job was not accepted: {run.tally.notes or job}")
        await run.follow(http, job, time.monotonic() + timeout)
    if run.tally.jobs[job] != "succeeded":
        raise RuntimeError(f"the warm-up job did not succeed: {run.tally.jobs[job]}")


# ---------------------------------------------------------------------------------------------- main


async def load_test(url: str, api_key: str, pid: int | None, options: argparse.Namespace, alive=lambda: True) -> dict:
    """Both phases against the server at `url` (whose process tree is `pid`, if known). Returns the report:
    {"phases": [row, ...], "usage": [row, ...], "notes": [...], "failures": [...]}."""
    usage = Usage(pid)
    await warm_up(Run(url, api_key, options, Tally()), options.drain_seconds)
    await asyncio.sleep(1.0)
    before = usage.now()
    stop = asyncio.Event()
    sampler = asyncio.create_task(usage.sample(stop))
    tallies = {"burst": Tally(), "sustained": Tally(), "hostile": Tally()}
    health_ms: list[float] = []
    prober = asyncio.create_task(health_probe(url, stop, health_ms))
    try:
        started = time.monotonic()
        await burst(Run(url, api_key, options, tallies["burst"]), options.burst, options.drain_seconds)
        burst_seconds = time.monotonic() - started
        started = time.monotonic()
        await asyncio.gather(
            sustained(
                Run(url, api_key, options, tallies["sustained"]),
                options.clients,
                options.sustain_seconds,
                options.drain_seconds,
            ),
            hostile(
                Run(url, api_key, options, tallies["hostile"]),
                options.hostile,
                options.sustain_seconds,
                options.drain_seconds,
            ),
        )
        sustained_seconds = time.monotonic() - started
    finally:
        stop.set()
        await sampler
        await prober
    await asyncio.sleep(2.0)  # let the last responses' buffers go
    after = usage.now()

    phases = [tallies["burst"].row("burst"), tallies["sustained"].row("sustained")]
    phases[0]["seconds"], phases[1]["seconds"] = f"{burst_seconds:.0f}", f"{sustained_seconds:.0f}"
    if options.hostile:
        phases.append(tallies["hostile"].row("hostile") | {"seconds": f"{sustained_seconds:.0f}"})
    health = sorted(health_ms)
    health_row = {
        "probes": len(health),
        "p50_ms": f"{health[len(health) // 2]:.1f}" if health else "nan",
        "p99_ms": f"{health[int(0.99 * (len(health) - 1))]:.1f}" if health else "nan",
        "max_ms": f"{health[-1]:.1f}" if health else "nan",
    }
    usage_rows = []
    if before and after:
        usage_rows = [
            {
                "server": "rss_MiB",
                "after_warm_up": f"{before[0]:.0f}",
                "peak": f"{usage.peak_rss:.0f}",
                "end": f"{after[0]:.0f}",
                "change": f"{after[0] - before[0]:+.0f}",
            },
            {
                "server": "open_fds",
                "after_warm_up": before[1],
                "peak": usage.peak_fds,
                "end": after[1],
                "change": f"{after[1] - before[1]:+d}",
            },
        ]
    failures = []
    for row in phases:
        for column in ("5xx", "transport_err", "lost", "unexpected"):
            if row[column]:
                failures.append(f"{row['phase']}: {row[column]} {column}")
    if options.hostile and health and float(health_row["p99_ms"]) > HEALTH_P99_MS:
        failures.append(f"/health p99 {health_row['p99_ms']} ms during the hostile run (at most {HEALTH_P99_MS})")
    health_ok = False
    if alive():
        try:
            async with httpx.AsyncClient(headers={"Authorization": f"Bearer {api_key}"}, timeout=10) as http:
                health_ok = (await http.get(f"{url}/health")).status_code == 200
        except httpx.HTTPError:
            pass
    if not health_ok:
        failures.append("the server does not answer /health at the end")
    notes = [f"{phase}: {note}" for phase, tally in tallies.items() for note in tally.notes]
    notes += [
        f"{phase}: job {job_id}: {fate}"
        for phase, tally in tallies.items()
        for job_id, fate in tally.jobs.items()
        if fate.startswith("lost")
    ][:20]
    return {"phases": phases, "usage": usage_rows, "health": health_row, "notes": notes, "failures": failures}


def print_report(report: dict) -> None:
    print_table(
        report["phases"],
        [
            "phase",
            "seconds",
            "calls",
            "accepted",
            "429",
            "5xx",
            "other_4xx",
            "transport_err",
            "succeeded",
            "cancelled",
            "lost",
            "unexpected",
            "mp4_decoded",
            "polls",
            "poll_p50_ms",
            "poll_p95_ms",
        ],
    )
    print()
    print_table(
        [{"what": "/health (every 0.1 s)", **report["health"]}], ["what", "probes", "p50_ms", "p99_ms", "max_ms"]
    )
    if report["usage"]:
        print()
        print_table(report["usage"], ["server", "after_warm_up", "peak", "end", "change"])
    else:
        print("server memory and descriptors: not measured (its process was not found; pass --pid)")
    for note in report["notes"]:
        print(f"note: {note}")
    print("FAIL: " + "; ".join(report["failures"]) if report["failures"] else "OK: no 5xx, no lost job", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server on a loopback address (default: start one)")
    parser.add_argument("--api-key", dest="api_key", help="its key (default with --url: $H3GEN_API_KEY)")
    parser.add_argument("--pid", type=int, help="with --url: the server's process (default: the one listening)")
    parser.add_argument("--model", help="checkpoint for the started server (default: the tiny demo model)")
    parser.add_argument("--device", choices=("cuda", "cpu"), help="device of the started server (default: its own)")
    parser.add_argument("--max-queue", dest="max_queue", type=int, default=10, help="of the started server")
    parser.add_argument("--no-ui", dest="ui", action="store_false", help="start the server without its web UI")
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="workers of the started server (`h3gen serve --workers N`: N > 1 starts N worker processes)",
    )
    parser.add_argument("--burst", type=int, default=50, help="clients in the burst (default 50)")
    parser.add_argument("--clients", type=int, default=16, help="clients in the sustained phase (default 16)")
    parser.add_argument(
        "--hostile", type=int, default=0, help="clients sending hostile requests beside the sustained ones (default 0)"
    )
    parser.add_argument("--sustain-seconds", dest="sustain_seconds", type=float, default=180.0)
    parser.add_argument(
        "--drain-seconds",
        dest="drain_seconds",
        type=float,
        default=600.0,
        help="how long accepted jobs may take to finish after a phase (default 600)",
    )
    parser.add_argument("--steps", type=int, default=4, help="num_inference_steps of each job (default 4)")
    parser.add_argument(
        "--burst-steps",
        dest="burst_steps",
        type=int,
        default=None,
        help="num_inference_steps of the burst's jobs (default --steps); jobs that outlast the burst keep the queue "
        "full while it is answered",
    )
    parser.add_argument("--poll-interval", dest="poll_interval", type=float, default=0.5)
    parser.add_argument("--cancel-fraction", dest="cancel_fraction", type=float, default=0.2)
    parser.add_argument(
        "--decode-every",
        dest="decode_every",
        type=int,
        default=3,
        help="decode every n-th MP4 in full with PyAV (default 3; 1 decodes all)",
    )
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args(argv)
    for name, low, high in (
        ("burst", 1, MAX_CLIENTS),
        ("clients", 1, MAX_CLIENTS),
        ("hostile", 0, MAX_CLIENTS),
        ("sustain_seconds", 0, MAX_SECONDS),
        ("drain_seconds", 1, MAX_SECONDS),
        ("poll_interval", 0.05, 10),
        ("cancel_fraction", 0, 1),
        ("decode_every", 1, 10**6),
        ("max_queue", 1, 10**4),
        ("steps", 2, 1000),
    ):
        if not low <= getattr(args, name) <= high:
            parser.error(f"--{name.replace('_', '-')} must be from {low} to {high} (got {getattr(args, name)})")
    args.burst_steps = args.burst_steps or args.steps
    if not 2 <= args.burst_steps <= 1000:
        parser.error(f"--burst-steps must be from 2 to 1000 (got {args.burst_steps})")
    if args.url:
        try:
            args.url = loopback_url(args.url)
        except ValueError as error:
            parser.error(str(error))
        args.api_key = args.api_key or os.environ.get("H3GEN_API_KEY")
        if not args.api_key:
            parser.error("--url needs --api-key (or $H3GEN_API_KEY): every call carries it")
    return args


def run(args: argparse.Namespace) -> dict:
    """The report of one load test as `args` (from `parse_args`) say: against `args.url`, or a server started for it
    (whose log tail joins the report when something failed)."""
    if args.url:
        pid = args.pid or listening_pid(urlsplit(args.url).port or 80)
        wait_ready(args.url, args.api_key, 60.0)
        return asyncio.run(load_test(args.url, args.api_key, pid, args))
    api_key = secrets.token_urlsafe(24)
    with tempfile.TemporaryDirectory(prefix="h3gen-load-") as workdir:
        server = LocalServer(
            Path(workdir), api_key=api_key, max_queue=args.max_queue, model=args.model, device=args.device, ui=args.ui
        )
        try:
            report = asyncio.run(load_test(server.url, api_key, server.pid, args, alive=server.alive))
        finally:
            server.stop()
        if report["failures"]:
            report["server_log_tail"] = server.log_tail()
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    print_report(report)
    if report.get("server_log_tail"):
        print("server log (tail):\n" + report["server_log_tail"])
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
