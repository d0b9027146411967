"""`benchmarks/load_test.py` in a very short run against the real server (tiny model), and its MP4 and address checks,
so the load test keeps working as the API changes."""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers.media_files import tone, write_video

from h3gen.pipelines.h3.tiny_checkpoint import tiny_checkpoint

# Starts `h3gen serve` or the CLI in processes of their own: minutes on the 2-core CI machine.
pytestmark = [pytest.mark.server, pytest.mark.slow]

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "load_test.py"


@pytest.fixture(scope="module")
def load_test():
    spec = importlib.util.spec_from_file_location("load_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["load_test"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("load_test", None)


def test_short_run_against_the_real_server(load_test, tmp_path_factory):
    model = tiny_checkpoint(cache_dir=tmp_path_factory.mktemp("cache"))
    # Client 1 cancels its first job and client 0 does not (their random streams are seeded by index).
    args = load_test.parse_args(
        [
            "--model",
            str(model),
            "--device",
            "cpu",
            "--no-ui",
            "--max-queue",
            "2",
            "--burst",
            "5",
            "--clients",
            "2",
            "--sustain-seconds",
            "3",
            "--drain-seconds",
            "300",
            "--steps",
            "2",
            "--burst-steps",
            "300",
            "--poll-interval",
            "0.5",
            "--cancel-fraction",
            "0.5",
            "--decode-every",
            "1",
            "--hostile",
            "1",
        ]
    )
    report = load_test.run(args)
    load_test.print_report(report)
    assert report["failures"] == [], report
    burst, sustained, hostile = report["phases"]
    assert hostile["calls"] >= 3 and hostile["5xx"] == hostile["unexpected"] == hostile["lost"] == 0
    assert report["health"]["probes"] > 10 and float(report["health"]["p99_ms"]) <= 100
    # One job may start running before the others arrive, so a queue of two holds two or three jobs. The burst's jobs
    # last about 3 s each (a 2-step tiny job can end while the burst is still being answered, freeing its place).
    assert 2 <= burst["accepted"] <= 3 and burst["429"] == 5 - burst["accepted"]
    assert burst["succeeded"] == burst["mp4_decoded"] == burst["accepted"]
    assert sustained["accepted"] >= 2 and sustained["cancelled"] >= 1 and sustained["succeeded"] >= 1
    assert sustained["5xx"] == sustained["other_4xx"] == sustained["lost"] == 0
    assert burst["polls"] > 0 and 0 < float(burst["poll_p50_ms"]) <= float(burst["poll_p95_ms"])
    rss, fds = report["usage"]
    assert rss["server"] == "rss_MiB" and float(rss["end"]) > 100 and fds["end"] > 3


def test_mp4_check_decodes_and_catches_broken_files(load_test, tmp_path):
    frames = np.zeros((12, 32, 48, 3), dtype=np.uint8)
    path = write_video(tmp_path / "clip.mp4", frames, fps=24, audio=tone(0.5, 32000), rate=32000)
    data = path.read_bytes()
    request = {"num_frames": 12, "width": 48, "height": 32, "audio_sample_rate": 32000}
    assert load_test.mp4_problem(data, request, decode=True) is None
    assert "frames" in load_test.mp4_problem(data, request | {"num_frames": 124}, decode=True)
    assert "audio" in load_test.mp4_problem(data, request | {"audio_sample_rate": 48000}, decode=True)
    assert load_test.mp4_problem(data[: len(data) // 3], request, decode=True) is not None
    assert load_test.mp4_problem(b"\0" * 4096, request, decode=False) is not None


def test_only_loopback_addresses(load_test):
    assert load_test.loopback_url("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"
    assert load_test.loopback_url("http://[::1]:8000") == "http://[::1]:8000"
    for url in ("http://10.1.2.3:8000", "http://192.168.0.1", "ftp://127.0.0.1", "127.0.0.1:8000"):
        with pytest.raises(ValueError):
            load_test.loopback_url(url)
