"""`random_pipeline`: the whole pipeline with random weights and no weight file, as the full-size benchmark builds
it, here at the tiny size; and a request written straight to an MP4 (`output_path`), the video encoded while the
audio decodes."""

import pytest
import torch

from h3gen.media import probe_mp4
from h3gen.pipelines.h3.random_weights import random_pipeline, write_config_folder


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    return random_pipeline("cpu", sizes="tiny", torch_dtype=torch.float32, folder=tmp_path_factory.mktemp("random"))


def test_the_config_folder_holds_no_weights(tmp_path):
    folder = write_config_folder(tmp_path, "tiny")
    assert not list(folder.rglob("*.safetensors"))
    assert (folder / "text_encoder" / "config.json").exists() and (folder / "vae" / "config.json").exists()


def test_random_weights_are_reproducible_and_finite(pipe, tmp_path):
    again = random_pipeline("cpu", sizes="tiny", torch_dtype=torch.float32, folder=tmp_path)
    for ours, theirs in (
        (pipe.transformer, again.transformer),
        (pipe.vae, again.vae),
        (pipe.text_encoder.model, again.text_encoder.model),
    ):
        for (name, a), (_, b) in zip(ours.state_dict().items(), theirs.state_dict().items(), strict=True):
            assert torch.equal(a, b), name
            assert torch.isfinite(a.float()).all(), name


def test_a_request_written_to_an_mp4_as_part_of_the_call(pipe, tmp_path):
    stages = []
    path = tmp_path / "clip.mp4"
    output = pipe(
        "a cat",
        seconds=5,
        num_inference_steps=3,
        seed=1,
        output_path=path,
        audio_sample_rate=48000,
        callback=lambda stage, step, total: stages.append((stage, step, total)),
    )
    assert output.video is None and output.path == str(path) and output.audio.shape[0] == 2
    info = probe_mp4(path)
    assert info == output.media
    assert (info.num_frames, info.width, info.height, info.sample_rate) == (124, 128, 64, 48000)
    assert abs(info.audio_seconds - info.video_seconds) <= 1 / 24
    assert list(dict.fromkeys(stage for stage, *_ in stages))[-3:] == ["decode_video", "decode_audio", "write_mp4"]
    writes = [(step, total) for stage, step, total in stages if stage == "write_mp4"]
    assert writes[0] == (0, 2 * 124) and writes[-1] == (2 * 124, 2 * 124)  # frames encoded, then read back
    assert [step for step, _ in writes] == sorted(step for step, _ in writes)
    with pytest.raises(ValueError, match="no frames"):
        output.save(tmp_path / "again.mp4")


def test_a_cancelled_write_leaves_no_file(pipe, tmp_path):
    path = tmp_path / "cancelled.mp4"

    def callback(stage, step, total):
        if stage == "write_mp4":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pipe("a cat", seconds=5, num_inference_steps=2, seed=1, output_path=path, callback=callback)
    assert not list(tmp_path.iterdir())


def test_a_request_over_the_gpu_budget_is_refused_before_any_model_work(pipe, monkeypatch):
    """Under layer-wise offload a request whose activations exceed what gpu_memory leaves them is refused by
    `validate`, naming both figures; a request that fits passes."""
    from h3gen.errors import RequestError
    from h3gen.pipelines.h3.request import activation_bytes, packed_rows

    request = pipe.validate("a cat", seconds=15)
    rows = packed_rows(request, len(pipe.text_encoder.tokenize("a cat")), pipe.config.patch_size)
    assert rows == 5 + 2 * 575 + 102 * 2 * 4  # text, two audio channels (345 frames), 102 latent frames of 2 x 4
    needed = activation_bytes(rows, pipe.config)
    monkeypatch.setattr(pipe.transformer, "activation_budget_bytes", needed - 1, raising=False)
    with pytest.raises(RequestError, match=r"activations need about .* GiB.*raise gpu_memory") as error:
        pipe("a cat", seconds=15, num_inference_steps=2, callback=lambda *a: pytest.fail("the model ran"))
    assert error.value.field == "seconds"
    monkeypatch.setattr(pipe.transformer, "activation_budget_bytes", needed, raising=False)
    pipe.validate("a cat", seconds=15)
