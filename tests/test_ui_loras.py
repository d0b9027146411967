"""The web UI's LoRA picker, through the real `h3gen serve --lora-dir` with the UI: it lists the folder's adapters
with their recipes, and a scale set there runs the adapter (the job's request names it)."""

import pytest
from helpers.recipe_files import write_turbo
from helpers.server_harness import Server, wait_for
from test_ui_security import KEY, call, generate_inputs, ui_client

from h3gen.pipelines.h3.tiny_checkpoint import tiny_checkpoint
from h3gen.ui.actions import chosen_loras

# Starts `h3gen serve` or the CLI in processes of their own: minutes on the 2-core CI machine.
pytestmark = [pytest.mark.server, pytest.mark.slow]

RECIPE = "LightX2V Turbo fl2v 8-step v1.0 768p"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("ui-loras")
    model = tiny_checkpoint(cache_dir=root / "cache")
    folder = root / "loras"
    folder.mkdir()
    turbo = write_turbo(folder, model)
    instance = Server(
        model,
        root / "results",
        ui=True,
        api_key=KEY,
        extra=("--lora-dir", str(folder)),
        env={"GRADIO_TEMP_DIR": str(root / "gradio-tmp")},
    )
    instance.turbo = turbo.name.removesuffix(".safetensors")
    yield instance
    instance.stop()


def _picker(config: dict) -> dict:
    return next(c for c in config["components"] if c.get("props", {}).get("elem_id") == "loras")


def test_the_picker_lists_the_folder_and_runs_the_chosen_adapter(server):
    with ui_client(server) as client:
        config = client.get("/ui/config").json()
        picker = _picker(config)["props"]
        assert picker["visible"] is not False and picker["headers"] == ["LoRA", "recipe", "scale"]
        assert picker["value"]["data"] == [[server.turbo, f"{RECIPE}: 8 forwards", 0]]
        kind, payload = call(
            client,
            "generate",
            generate_inputs(
                steps=0, loras={"headers": ["LoRA", "recipe", "scale"], "data": [[server.turbo, RECIPE, 0.6]]}
            ),
        )
        assert kind == "complete", payload
        status = payload[0]
        assert "8 forwards" in status and f"LoRA {server.turbo} x0.6" in status, status
    with server.client() as rest:
        job = rest.get("/v1/videos").json()["data"][0]
        view = wait_for(rest, job["id"])
    assert view["request"]["loras"] == [{"name": server.turbo, "scale": 0.6}] and view["request"]["forwards"] == 8


def test_rows_with_scale_zero_are_left_out_and_a_bad_scale_is_named():
    assert chosen_loras([["a", "", 0], ["b", "", 0.5], ["c", "", "1"]]) == [
        {"name": "b", "scale": 0.5},
        {"name": "c", "scale": 1.0},
    ]
    assert chosen_loras(None) == []
    with pytest.raises(ValueError, match="scale of LoRA a"):
        chosen_loras([["a", "", "lots"]])
