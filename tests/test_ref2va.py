"""ref2va (omni-reference) against diffusers' MiniMax-H3 ref2va ModularPipeline on tiny checkpoints (fp32, CPU):
layout, sound resampling, video preprocessing, whole-pipeline parity for every kind of reference, and the errors."""

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.h3_reference import load_ref2va_reference, run_ref2va_reference, torchvision_substitute
from helpers.media_files import moving_frames, tone, write_audio, write_video
from PIL import Image

from h3gen.errors import RequestError
from h3gen.pipelines.h3.packing import ReferenceBlock, build_ref2va_layout
from h3gen.pipelines.h3.pipeline import AudioReference, H3Pipeline, ImageReference, VideoReference
from h3gen.pipelines.h3.references import resample_audio
from h3gen.pipelines.h3.tiny_checkpoint import build_tiny_checkpoint
from h3gen.pipelines.h3.video_processor import QwenVideoProcessor

# Whole ref2va requests against diffusers' on the CPU: outside the fast tier.
pytestmark = pytest.mark.slow

TOLERANCE = 1e-4
GOLDEN = Path(__file__).with_name("data") / "golden_ref2va.npz"
# A second tiny transformer with odd sizes: 3 heads x 16, hidden 40, one layer each.
ODD_TRANSFORMER = dict(
    num_attention_heads=3,
    attention_head_dim=16,
    hidden_size=40,
    num_layers=1,
    num_refiner_layers=1,
    ffn_dim=72,
    freq_dim=18,
    time_embed_hidden_dim=36,
    time_embed_dim=20,
    rope_freq_dim=2,
)


@pytest.fixture(scope="module")
def odd_dir(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("odd") / "tiny", seed=5, transformer=ODD_TRANSFORMER)


@pytest.fixture(scope="module")
def ours(tiny_dir):
    return H3Pipeline.from_pretrained(tiny_dir, device="cpu", torch_dtype=torch.float32, workflow="all")


@pytest.fixture(scope="module")
def reference(tiny_dir):
    return load_ref2va_reference(tiny_dir)


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    rng = np.random.default_rng(7)
    Image.fromarray(rng.integers(0, 256, (37, 91, 3), dtype=np.uint8)).save(folder / "wide.png")
    Image.fromarray(rng.integers(0, 256, (77, 50, 3), dtype=np.uint8)).save(folder / "tall.png")
    write_video(folder / "sound.mp4", moving_frames(50, 48, 86, seed=1), 30, tone(2.1, 48000, seed=1), 48000)
    write_video(folder / "silent.mp4", moving_frames(40, 70, 52, seed=2), 24)
    write_video(folder / "short.mp4", moving_frames(10, 48, 64, seed=3), 24)
    write_audio(folder / "voice.wav", tone(1.5, 32000, channels=1, seed=4), 32000)
    write_audio(folder / "music.mp3", tone(2.5, 44100, seed=5), 44100)
    write_audio(folder / "speech.m4a", tone(6.2, 48000, seed=6), 48000)
    write_audio(folder / "long.wav", tone(61.0, 8000, channels=1), 8000)
    (folder / "notes.txt").write_text("not media at all")
    data = (folder / "sound.mp4").read_bytes()
    (folder / "cut.mp4").write_bytes(data[: len(data) // 4])
    return folder


# ---------------------------------------------------------------------------------------------- pieces


@pytest.mark.parametrize(
    "blocks",
    [
        [ReferenceBlock("image", 1, 6, 10)],
        [ReferenceBlock("audio", audio_latents=5), ReferenceBlock("image", 1, 4, 8), ReferenceBlock("image", 1, 10, 4)],
        [
            ReferenceBlock("video", 7, 4, 6, audio_latents=80),
            ReferenceBlock("audio", audio_latents=3),
            ReferenceBlock("video", 17, 6, 4),
            ReferenceBlock("image", 1, 4, 4),
        ],
    ],
)
def test_ref2va_layout_matches_diffusers(blocks):
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3Ref2VAPrepareLayoutStep
    from diffusers.modular_pipelines.minimax_h3.references import (
        MiniMaxH3AudioReference,
        MiniMaxH3ImageReference,
        MiniMaxH3VideoReference,
    )

    tags = torch.ones(23, dtype=torch.long)
    tags[3:9] = 0
    refs, visual, sound = [], [], []
    for block in blocks:
        audio = torch.zeros(2, 1) if block.audio_latents else None
        refs.append(
            {
                "image": lambda: MiniMaxH3ImageReference(image=None),
                "video": lambda audio=audio: MiniMaxH3VideoReference(frames=None, audio=audio),
                "audio": lambda audio=audio: MiniMaxH3AudioReference(audio=audio),
            }[block.kind]()
        )
        if block.kind != "audio":
            visual.append(torch.zeros(1, 24, block.latent_frames, block.latent_height, block.latent_width))
        if block.audio_latents:
            sound.append(torch.zeros(2 * block.audio_latents, 32))
    expected = MiniMaxH3Ref2VAPrepareLayoutStep.build_ref2va_packed_sequence(
        tags, refs, visual, sound, 17, 4, 6, 83, (1, 2, 2), 2, 2, 0
    )
    layout = build_ref2va_layout(tags, blocks, 17, 4, 6, 83)
    got = (
        layout.position_ids,
        layout.token_tags,
        layout.video_indices,
        layout.audio_indices,
        layout.text_indices,
        layout.num_condition_video_rows,
        layout.num_condition_audio_rows,
    )
    for ours_part, theirs in zip(got, expected, strict=True):
        if isinstance(theirs, torch.Tensor):
            assert ours_part.dtype == theirs.dtype and torch.equal(ours_part, theirs)
        else:
            assert ours_part == theirs


def test_resampling_equals_torchaudio():
    golden = np.load(GOLDEN)
    for index in range(5):
        orig, new = (int(rate) for rate in golden[f"resample{index}_rates"])
        out = resample_audio(torch.from_numpy(golden[f"resample{index}_in"]), orig, new).numpy()
        assert out.shape == golden[f"resample{index}_out"].shape
        assert np.abs(out - golden[f"resample{index}_out"]).max() <= 1e-6, (orig, new)
    t = np.arange(44100) / 44100  # and it is a resampler: a 1 kHz sine comes out as the same sine at 32 kHz
    out = resample_audio(torch.from_numpy(np.sin(2 * np.pi * 1000 * t)[None].astype(np.float32)), 44100, 32000)
    expected = np.sin(2 * np.pi * 1000 * np.arange(out.shape[-1]) / 32000)
    assert np.abs(out[0, 200:-200].numpy() - expected[200:-200]).max() < 1e-2


def test_video_preprocessing_equals_transformers():
    golden = np.load(GOLDEN)
    for index in range(4):
        processor = QwenVideoProcessor(min_pixels=64 * 64, max_pixels=int(golden[f"video{index}_longest_edge"]))
        features = processor([golden[f"video{index}_in"]])
        assert features["video_grid_thw"].tolist() == golden[f"video{index}_grid"].tolist()
        pixels = features["pixel_values_videos"].numpy() * 127.5 + 127.5
        assert np.abs(pixels - golden[f"video{index}_pixels"]).max() < 1e-3


def test_video_preprocessing_equals_transformers_processor_on_substitute_ops(tiny_dir):
    from helpers.h3_reference import reference_video_processor

    video = moving_frames(9, 70, 110, seed=9)
    with torchvision_substitute():
        expected = reference_video_processor(tiny_dir)(videos=[video], do_sample_frames=False, return_tensors="pt")
    got = QwenVideoProcessor.from_folder(tiny_dir / "processor")([video])
    assert torch.equal(got["video_grid_thw"], expected["video_grid_thw"])
    assert torch.equal(got["pixel_values_videos"], expected["pixel_values_videos"])


# ---------------------------------------------------------------------------------------------- whole pipeline


def _case(name, media):
    """(diffusers references, h3gen references) for a parity case; paths are decoded by each side itself."""
    rng = np.random.default_rng(11)
    frames = rng.integers(0, 256, (30, 60, 44, 3), dtype=np.uint8)
    sound = torch.from_numpy(tone(1.2, 32000, seed=8))
    wide = Image.open(media / "wide.png").convert("RGB")
    cases = {
        "images": (
            [("image", dict(image=wide)), ("image", media / "tall.png")],
            [wide, ImageReference(media / "tall.png")],
        ),
        "video_with_soundtrack": ([("video", media / "sound.mp4")], [media / "sound.mp4"]),
        "video_without_soundtrack": (
            [("image", media / "wide.png"), ("video", media / "silent.mp4")],
            [media / "wide.png", VideoReference(media / "silent.mp4")],
        ),
        "audio": (
            [("image", media / "tall.png"), ("audio", media / "voice.wav")],
            [ImageReference(np.asarray(Image.open(media / "tall.png"))), AudioReference(media / "voice.wav")],
        ),
        "mixed": (
            [
                ("audio", media / "music.mp3"),
                ("video", dict(frames=frames, fps=20.0, audio=sound)),
                ("image", media / "wide.png"),
                ("video", media / "silent.mp4"),
            ],
            [
                AudioReference(media / "music.mp3"),
                VideoReference(frames, fps=20, audio=sound.numpy()),
                ImageReference(media / "wide.png"),
                media / "silent.mp4",
            ],
        ),
    }
    return cases[name]


def _run(pipe, prompt, references, **kwargs):
    """A call, and the final latents it decoded `(video (1, C, F, h, w), audio (2, C, A))`, caught at the decoders."""
    from unittest import mock

    from h3gen.pipelines.h3 import decode_stages as module

    caught = {}

    def catch(name, decode):
        return lambda vae, latents, **kwargs: (
            caught.__setitem__(name, latents.clone()),
            decode(vae, latents, **kwargs),
        )[1]

    with (
        mock.patch.object(module, "decode_video", catch("video", module.decode_video)),
        mock.patch.object(module, "decode_audio", catch("audio", module.decode_audio)),
    ):
        output = pipe(prompt, references=references, **kwargs)
    return output, (caught["video"], caught["audio"])


def _assert_matches(run, expected):
    output, (latents, audio_latents) = run
    video, audio, expected_latents, expected_audio_latents = expected
    assert output.video.shape == video.shape and output.audio.shape == audio.shape
    # The latents too: the tiny model's decoded audio is quiet, its latents are not.
    assert (latents - expected_latents).abs().max() <= TOLERANCE
    assert (audio_latents - expected_audio_latents).abs().max() <= TOLERANCE
    assert np.abs(output.video - video).max() <= TOLERANCE
    assert np.abs(output.audio - audio).max() <= TOLERANCE
    assert output.video.std() > 1e-3 and np.abs(output.audio).max() > 1e-5  # real content, not zeros


@pytest.mark.parametrize("case", ["images", "video_with_soundtrack", "video_without_soundtrack", "audio", "mixed"])
def test_ref2va_matches_diffusers(case, ours, reference, media):
    theirs, mine = _case(case, media)
    prompt = "a bird sings on a branch"
    expected = run_ref2va_reference(reference, prompt, 3, theirs, num_frames=130, num_inference_steps=3)
    _assert_matches(_run(ours, prompt, mine, num_frames=130, num_inference_steps=3, seed=3), expected)


def test_ref2va_matches_diffusers_with_an_odd_transformer(odd_dir, media):
    theirs, mine = _case("mixed", media)
    expected = run_ref2va_reference(
        load_ref2va_reference(odd_dir), "rain", 8, theirs, num_frames=200, num_inference_steps=4, height=96, width=64
    )
    pipe = H3Pipeline.from_pretrained(odd_dir, device="cpu", torch_dtype=torch.float32, workflow="ref2va")
    assert pipe.transformer is None and pipe.config.num_attention_heads == 3
    run = _run(pipe, "rain", mine, num_frames=200, num_inference_steps=4, height=96, width=64, seed=8)
    assert run[0].video.shape[:3] == (209, 96, 64)
    _assert_matches(run, expected)


def test_every_reference_moves_the_result(ours, media):
    kwargs = dict(num_frames=130, num_inference_steps=3, seed=3)
    _, first = _run(ours, "x", [media / "wide.png", AudioReference(media / "voice.wav")], **kwargs)
    for changed in (
        [media / "tall.png", AudioReference(media / "voice.wav")],
        [media / "wide.png", AudioReference(media / "music.mp3")],
        [AudioReference(media / "voice.wav"), media / "wide.png"],
    ):  # order matters too
        _, other = _run(ours, "x", changed, **kwargs)
        assert (first[0] - other[0]).abs().max() > 10 * TOLERANCE  # parity holds to 1e-4; these move by more
        assert (first[1] - other[1]).abs().max() > 10 * TOLERANCE


def test_duration_comes_from_the_first_reference_with_sound(ours, media):
    kwargs = dict(num_inference_steps=2, seed=0)
    assert ours.validate("x", references=[media / "tall.png", media / "speech.m4a"], **kwargs).shape.num_frames == 158
    assert ours.validate("x", references=[media / "tall.png"], **kwargs).shape.num_frames == 124  # 5 s default
    short = ours.validate("x", references=[media / "sound.mp4"], **kwargs)  # 2.1 s of sound: held at 5 s
    assert short.shape.num_frames == 124
    explicit = ours.validate("x", references=[media / "speech.m4a", media / "wide.png"], seconds=10, **kwargs)
    assert explicit.shape.num_frames == 243


def test_callback_reports_each_reference(ours, media):
    events = []
    ours(
        "x",
        references=[media / "wide.png", media / "voice.wav"],
        num_inference_steps=2,
        seed=0,
        callback=lambda stage, step, total: events.append((stage, step, total)),
    )
    # Step 0 marks the stage's start; the step then counts the references done (2), repeated at the cancellation
    # points inside each reference's encoding, never going back.
    steps = [step for stage, step, total in events if stage == "encode_conditions" and total == 2]
    assert steps[0] == 0 and steps[-1] == 2 and steps == sorted(steps) and set(steps) == {0, 1, 2}


# ---------------------------------------------------------------------------------------------- errors


def _bad(media):
    return {
        "too_many_images": ([media / "wide.png"] * 10, "references[9]", "at most 9 image"),
        "too_many_videos": ([media / "silent.mp4"] * 4, "references[3]", "at most 3 video"),
        "too_many_in_all": (
            [media / "wide.png"] * 9 + [media / "silent.mp4"] * 3 + [media / "voice.wav"],
            "references[12]",
            "at most 12 references",
        ),
        "audio_only": ([media / "voice.wav", media / "music.mp3"], "references[0]", "cannot be the only"),
        "corrupt_video": ([VideoReference(media / "cut.mp4")], "references[0]", "not a readable"),
        "wrong_type": ([media / "notes.txt"], "references[0]", "neither an image, a video nor an audio"),
        "image_as_video": ([VideoReference(media / "wide.png", name="ref_video")], "ref_video", "still image"),
        "text_as_image": ([ImageReference(media / "notes.txt")], "references[0]", "not a readable image"),
        "video_as_audio": (
            [media / "wide.png", AudioReference(media / "silent.mp4")],
            "references[1]",
            "no audio stream",
        ),
        "too_long": ([media / "wide.png", media / "long.wav"], "references[1]", "at most 60 s"),
        "too_short_video": ([media / "short.mp4"], "references[0]", "too short"),
        "bare_array": ([np.zeros((10, 60, 3), np.uint8)], "references[0]", "must be a file path"),
        "bad_aspect_image": ([ImageReference(np.zeros((10, 60, 3), np.uint8))], "references[0]", "1:4 and 4:1"),
        "missing_file": ([media / "nowhere.png"], "references[0]", "does not exist"),
        "empty": ([], "references", "at least one reference"),
        "not_a_list": (media / "wide.png", "references", "must be a list"),
        "bad_audio_array": (
            [media / "wide.png", AudioReference(np.zeros((3, 100), np.float32))],
            "references[1]",
            "mono or stereo",
        ),
    }


@pytest.mark.parametrize("which", list(_bad(Path("."))))
def test_bad_references_raise_request_errors_naming_them(which, ours, media):
    references, field, message = _bad(media)[which]
    with pytest.raises(RequestError) as info:
        ours("x", references=references, num_inference_steps=2, seed=0)
    assert info.value.field == field and message in str(info.value), str(info.value)


def test_references_need_the_ref_partition_and_no_keyframes(tiny_dir, ours, media):
    t2va = H3Pipeline.from_pretrained(tiny_dir, device="cpu", torch_dtype=torch.float32)
    with pytest.raises(RequestError, match="transformer_ref"):
        t2va("x", references=[media / "wide.png"], num_inference_steps=2)
    with pytest.raises(RequestError, match="not both") as info:
        ours("x", image=media / "wide.png", references=[media / "tall.png"], num_inference_steps=2)
    assert info.value.field == "references"
