"""Test-wide settings: no network, deterministic CPU threads, shared helpers for tiny H3 models, and a throw-away
PostgreSQL server for the job store tests (`helpers/postgres.py`)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("DO_NOT_TRACK", "1")

import pytest
import torch
from helpers.postgres import postgres_cluster, postgres_url  # noqa: F401  (fixtures for every test module)

torch.set_num_threads(min(2, os.cpu_count() or 1))
if not torch.cuda.is_available():
    # Triton reads this when a kernel is defined, and a library imported while collecting (diffusers, peft) may
    # import Triton first: set here, before any test module, the tests' Triton kernels all run in the interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _stop_what_the_test_started():
    """Kill every process group a test started (through `server_harness`) and left running, passed or failed.
    Servers of fixtures scoped to a module or to the whole run start before this runs and are theirs to stop."""
    from helpers.server_harness import STARTED, kill_group

    before = set(STARTED)
    yield
    for process in [process for process in STARTED if process not in before]:
        kill_group(process)
        STARTED.remove(process)


def pytest_sessionfinish(session, exitstatus):
    """Whatever a fixture's teardown did not stop (a teardown that failed) goes with the session."""
    from helpers.server_harness import STARTED, kill_group

    while STARTED:
        kill_group(STARTED.pop())


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """The tiny random-weight MiniMax-H3 checkpoint in the released on-disk layout, built once per run (tests read
    it and never write into it)."""
    from h3gen.pipelines.h3.tiny_checkpoint import tiny_checkpoint

    return tiny_checkpoint(cache_dir=tmp_path_factory.mktemp("cache"))


@pytest.fixture
def seeded():
    torch.manual_seed(0)
    yield
