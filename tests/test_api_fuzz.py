"""Schemathesis drives every operation of the OpenAPI schema with generated input: no response may be a 5xx."""

import pytest
import schemathesis
from helpers.server_harness import wait_loaded
from hypothesis import HealthCheck, given, settings

from h3gen.pipelines.h3.tiny_checkpoint import tiny_checkpoint
from h3gen.server.app import create_app
from h3gen.server.engine import H3Engine
from h3gen.server.jobs import JobManager

# Starts `h3gen serve` or the CLI in processes of their own: minutes on the 2-core CI machine.
pytestmark = [pytest.mark.server, pytest.mark.slow]


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    engine = H3Engine(tiny_checkpoint(cache_dir=root / "cache"), device="cpu")
    manager = JobManager(engine, root / "results", max_queue=2)
    manager.start()
    assert wait_loaded(engine, 120)
    yield create_app(manager)
    manager.stop()


@pytest.fixture(scope="module")
def api_schema(app):
    return schemathesis.openapi.from_asgi("/openapi.json", app)


def test_no_server_errors(api_schema):
    # Driven through hypothesis directly (schemathesis' pytest plugin does not support this pytest version).
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 7
    seen = []
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case):
            response = case.call()
            seen.append((operation.label, response.status_code))  # noqa: B023 - run within this iteration
            assert response.status_code < 500, (
                f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:500]}"
            )

        check()
    # The run really exercised every operation (one without parameters, GET /v1/loras, yields few distinct cases).
    assert {label for label, _ in seen} == {operation.label for operation in operations}
    assert len(seen) >= 15 * len(operations)
    # and a valid job reaches the engine through the same generated-case machinery (random optional fields, each
    # with its own rules, make a fully valid generated body rare)
    create = next(
        operation for operation in operations if operation.method.upper() == "POST" and operation.path == "/v1/videos"
    )
    valid = create.Case(body={"prompt": "a cat", "seconds": 5, "num_inference_steps": 3}, media_type="application/json")
    assert valid.call().status_code in (202, 429)
