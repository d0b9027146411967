"""The K3 vision path: tower + projector against float64 code written from the equations, the image processor's
resize rule against transformers' `navit_resize` (the same rule, independent code) and values derived by hand,
patch layout and normalisation, the prompt's media span, and the tiny checkpoint generating from an image."""

import json

import numpy as np
import pytest
import torch
from helpers.k3_reference import hf_navit_resize, max_rel_error, vision_reference
from PIL import Image

from h3gen.errors import CheckpointError
from h3gen.pipelines.k3.demo_model import MEDIA_PAD_ID, build_tiny_checkpoint, randomize
from h3gen.pipelines.k3.image_processor import K3ImageProcessor, K3MediaConfig, navit_resize
from h3gen.pipelines.k3.model import K3ForCausalLM
from h3gen.pipelines.k3.tokenizer import K3Tokenizer
from h3gen.pipelines.k3.vision import K3MultiModalProjector, K3VisionConfig, K3VisionTower

VISION = dict(
    patch_size=6,
    init_pos_emb_height=5,
    init_pos_emb_width=7,
    init_pos_emb_time=3,
    vt_num_attention_heads=3,
    vt_num_hidden_layers=2,
    vt_hidden_size=18,
    vt_intermediate_size=26,
    qkv_hidden_size=24,
    merge_kernel_size=[2, 2],
)


class _Vision(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.vision_tower = K3VisionTower(config)
        self.mm_projector = K3MultiModalProjector(config)


@pytest.mark.parametrize(
    "grids",
    [
        [(1, 4, 6), (1, 2, 2), (1, 6, 4)],  # interpolated tables, odd aspect, the smallest grid
        [(1, 6, 8), (1, 4, 4)],
        [(2, 2, 4), (1, 4, 2)],  # a two-frame clip: time embedding and the frame average
    ],
)
def test_vision_tower_and_projector_match_float64_equations(grids):
    config = K3VisionConfig.from_dict(VISION, text_hidden_size=22)
    model = randomize(_Vision(config), seed=len(grids)).float().eval()
    n = sum(t * h * w for t, h, w in grids)
    pixels = torch.randn(n, 3, 6, 6, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        actual = model.mm_projector(model.vision_tower(pixels, torch.tensor(grids)))
    expected = vision_reference(model.state_dict(), config, pixels, grids, torch.finfo(torch.float32).eps)
    assert actual.shape == (sum(h * w // 4 for _, h, w in grids), 22)
    assert max_rel_error(actual, expected) <= 1e-4


def test_vision_tower_uses_the_table_as_is_when_the_grid_matches_it():
    config = K3VisionConfig.from_dict(VISION, text_hidden_size=22)
    model = randomize(_Vision(config), seed=5).float().eval()
    grids = [(1, 5 - 1, 7 - 1), (1, 5 + 1, 7 + 1)]
    model.vision_tower.patch_embed.pos_emb.weight.data = torch.randn(4, 6, 18)  # now equal to the first grid
    pixels = torch.randn(24 + 48, 3, 6, 6, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        actual = model.mm_projector(model.vision_tower(pixels, grids))
    expected = vision_reference(model.state_dict(), config, pixels, grids, torch.finfo(torch.float32).eps)
    assert max_rel_error(actual, expected) <= 1e-4


def test_vision_rejects_bad_grids_and_configs():
    config = K3VisionConfig.from_dict(VISION, text_hidden_size=22)
    tower = K3VisionTower(config)
    with pytest.raises(ValueError, match="multiples of the merge"):
        tower(torch.zeros(3 * 4, 3, 6, 6), [(1, 3, 4)])
    with pytest.raises(ValueError, match=r"pixel_values must be \[8, 3, 6, 6\]"):
        tower(torch.zeros(9, 3, 6, 6), [(1, 2, 4)])
    with pytest.raises(CheckpointError, match="merge_type"):
        K3VisionConfig.from_dict(dict(VISION, merge_type="sd2"), 22)
    with pytest.raises(CheckpointError, match="heads of a multiple of 4"):
        K3VisionConfig.from_dict(dict(VISION, qkv_hidden_size=30), 22)


# --- image processor ---------------------------------------------------------------------------------------------

SIZES = [
    (1, 1),
    (13, 13),
    (14, 14),
    (27, 29),
    (28, 28),
    (29, 57),
    (640, 480),
    (1920, 1080),
    (4032, 3024),
    (7168, 7168),
    (7169, 7168),
    (20000, 10),
    (10, 20000),
    (100000, 14),
    (3, 65000),
    (12345, 6789),
]


@pytest.mark.parametrize("limits", [(16384, 512), (48, 10), (4096, 64)])
def test_navit_resize_matches_transformers(limits):
    hf = hf_navit_resize()
    config = K3MediaConfig(in_patch_limit=limits[0], patch_limit_on_one_side=limits[1])
    for width, height in SIZES:
        ours = navit_resize(width, height, config)
        (new_h, new_w), (pad_h, pad_w) = hf(height, width, 14, 2, limits[0], limits[1])
        assert (ours.new_width, ours.new_height) == (new_w, new_h), (width, height)
        assert ours.padded == (pad_w, pad_h), (width, height)
        assert ours.num_tokens == (pad_w // 28) * (pad_h // 28)
        assert ours.padded[0] % 28 == 0 and ours.padded[1] % 28 == 0
        assert ours.new_width <= width and ours.new_height <= height  # never upscaled


@pytest.mark.parametrize(
    "size, resized, padded, tokens",
    [
        ((1, 1), (1, 1), (28, 28), 1),  # tiny: kept, padded to one merged token
        ((28, 56), (28, 56), (28, 56), 2),  # already on the grid
        ((3000, 30), (3000, 30), (3024, 56), 108 * 2),  # extreme aspect inside both limits: kept
        ((7168, 7168), (1792, 1792), (1792, 1792), 64 * 64),  # 512x512 patches -> budget 16384: scale 1/4
        ((14336, 28), (7168, 14), (7168, 28), 256),  # the per-side limit (512 patches) halves it
    ],
)
def test_navit_resize_hand_derived_values(size, resized, padded, tokens):
    resize = navit_resize(*size, K3MediaConfig())
    assert (resize.new_width, resize.new_height) == resized
    assert resize.padded == padded
    assert resize.num_tokens == tokens


def _expected_patches(rgb: np.ndarray, padded, mean, std, p=14):
    """Pad with zeros, normalise, and cut row-major patches, by explicit loops."""
    height, width = padded[1], padded[0]
    canvas = np.zeros((height, width, 3))
    canvas[: rgb.shape[0], : rgb.shape[1]] = rgb
    norm = (canvas / 255.0 - np.array(mean)) / np.array(std)
    out = []
    for r in range(height // p):
        for c in range(width // p):
            out.append(norm[r * p : (r + 1) * p, c * p : (c + 1) * p].transpose(2, 0, 1))
    return torch.tensor(np.stack(out))


@pytest.mark.parametrize("kind", ["pil", "numpy", "torch_chw", "gray"])
def test_processor_pads_normalises_and_patchifies(kind):
    config = K3MediaConfig(image_mean=(0.48, 0.46, 0.41), image_std=(0.27, 0.26, 0.28))
    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, (17, 31, 3), dtype=np.uint8)  # 31 wide, 17 high: no resize, padded to 56 x 28
    image = {
        "pil": Image.fromarray(rgb),
        "numpy": rgb,
        "torch_chw": torch.from_numpy(rgb).permute(2, 0, 1),
        "gray": rgb[..., 0],
    }[kind]
    if kind == "gray":
        rgb = np.repeat(rgb[..., :1], 3, axis=-1)
    out = K3ImageProcessor(config)([image])
    assert out.grid_thws.tolist() == [[1, 2, 4]] and out.num_tokens == [2] and out.image_sizes == [(31, 17)]
    expected = _expected_patches(rgb, (56, 28), config.image_mean, config.image_std)
    assert max_rel_error(out.pixel_values, expected) < 1e-6
    pad = -np.array(config.image_mean) / np.array(config.image_std)  # bottom-right patch is mostly padding
    assert torch.allclose(out.pixel_values[-1, :, -1, -1], torch.tensor(pad, dtype=torch.float32))


def test_processor_resizes_with_pil_bicubic_and_fills_transparency():
    config = K3MediaConfig(in_patch_limit=48, patch_limit_on_one_side=10, transparent_bg_config={"pattern": "white"})
    rgba = np.zeros((90, 200, 4), dtype=np.uint8)
    rgba[..., 0] = 255  # red, fully transparent: becomes white
    rgba[:45, :, 3] = 255  # top half opaque red
    out = K3ImageProcessor(config)(Image.fromarray(rgba, mode="RGBA"))
    resize = navit_resize(200, 90, config)
    assert out.grid_thws.tolist() == [[1, resize.padded[1] // 14, resize.padded[0] // 14]]
    patches = out.pixel_values.view(resize.padded[1] // 14, resize.padded[0] // 14, 3, 14, 14)
    image = patches.permute(2, 0, 3, 1, 4).reshape(3, resize.padded[1], resize.padded[0])
    pixels = image * torch.tensor(config.image_std).view(3, 1, 1) + torch.tensor(config.image_mean).view(3, 1, 1)
    assert torch.allclose(pixels[:, 0, 0], torch.tensor([1.0, 0.0, 0.0]), atol=1e-6)  # opaque red
    assert torch.allclose(pixels[:, resize.new_height - 1, 0], torch.ones(3), atol=1e-6)  # white background
    reference = np.asarray(
        Image.fromarray(rgba, mode="RGBA").resize((resize.new_width, resize.new_height), Image.Resampling.BICUBIC),
        dtype=np.float64,
    )
    alpha = reference[..., 3:] / 255.0
    expected = np.floor(np.clip(alpha * reference[..., :3] + (1 - alpha) * 255.0, 0, 255)) / 255.0
    actual = pixels[:, : resize.new_height, : resize.new_width].permute(1, 2, 0).double().numpy()
    # the composite is floored: float32 (ours, as sglang) and float64 (here) may land one level apart
    assert np.abs(actual - expected).max() < 1 / 255 + 1e-6 and (np.abs(actual - expected) > 1e-6).mean() < 0.01
    assert (pixels[:, resize.new_height :, :].abs() < 1e-6).all()  # zero padding (before normalisation)


def test_processor_errors_are_clear():
    processor = K3ImageProcessor(K3MediaConfig(max_images=2))
    with pytest.raises(TypeError, match="image 0 is a str"):
        processor(["cat.png"])
    with pytest.raises(TypeError, match="uint8"):
        processor([torch.rand(3, 20, 20)])
    with pytest.raises(ValueError, match="empty"):
        processor([np.zeros((0, 5, 3), dtype=np.uint8)])
    with pytest.raises(ValueError, match="empty"):
        processor([Image.new("RGB", (0, 4))])
    with pytest.raises(ValueError, match="3 images; at most 2"):
        processor([np.zeros((4, 4, 3), dtype=np.uint8)] * 3)
    with pytest.raises(ValueError, match="shape"):
        processor([np.zeros((4, 4, 2), dtype=np.uint8)])
    with pytest.raises(ValueError, match="no images"):
        processor([])
    with pytest.raises(CheckpointError, match="pattern"):
        K3MediaConfig.from_dict({"media_proc_cfg": {"transparent_bg_config": {"pattern": "plaid"}}})


# --- the tiny checkpoint with an image ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_k3(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-k3-vision"), seed=0)


def _image(width, height, seed):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def _prompt(folder, images):
    tokenizer = K3Tokenizer.from_folder(folder)
    processed = K3ImageProcessor.from_folder(folder)(images)
    parts = (
        [{"type": "text", "text": "what is in"}]
        + [{"type": "image"} for _ in images]
        + [{"type": "text", "text": "the picture?"}]
    )
    ids = tokenizer.apply_chat_template([{"role": "user", "content": parts}], thinking=False)
    ids = tokenizer.expand_images(ids, processed.num_tokens, processed.image_sizes)
    return tokenizer, processed, torch.tensor([ids])


def test_tiny_k3_loads_vision_weights_under_the_checkpoint_keys(tiny_k3):
    from safetensors import safe_open

    with safe_open(str(tiny_k3 / "model.safetensors"), "pt") as handle:
        keys = set(handle.keys())
    for key in (
        "vision_tower.patch_embed.proj.weight",
        "vision_tower.patch_embed.pos_emb.weight",
        "vision_tower.encoder.blocks.1.wqkv.weight",
        "vision_tower.encoder.blocks.0.mlp.fc1.weight",
        "vision_tower.encoder.final_layernorm.weight",
        "mm_projector.proj.0.weight",
        "mm_projector.proj.2.weight",
        "mm_projector.post_norm.weight",
    ):
        assert key in keys
    model = K3ForCausalLM.from_pretrained(tiny_k3, torch_dtype=torch.float32)
    with safe_open(str(tiny_k3 / "model.safetensors"), "pt") as handle:
        assert torch.equal(model.mm_projector.proj[0].weight, handle.get_tensor("mm_projector.proj.0.weight").float())
    config = json.loads((tiny_k3 / "config.json").read_text())
    assert model.vision_tower.config.vt_hidden_size == config["vision_config"]["vt_hidden_size"]


def test_tiny_k3_checkpoint_with_mxfp4_experts_and_an_image_generates_greedy(tiny_k3):
    model = K3ForCausalLM.from_pretrained(tiny_k3, torch_dtype=torch.float32)
    assert type(model.model.layers[1].mlp.experts[0].w1).__name__ == "MXFP4Linear"
    tokenizer, processed, ids = _prompt(tiny_k3, [_image(61, 45, 0), _image(30, 100, 1)])
    assert processed.num_tokens == [6, 8]  # 61x45 -> 84x56 padded (3x2 merged), 30x100 -> 56x112 (2x4)
    text = tokenizer.decode(ids[0].tolist())
    assert "<|media_begin|>image 61x45<|media_content|>" + "<|media_pad|>" * 6 + "<|media_end|>" in text
    assert int((ids == MEDIA_PAD_ID).sum()) == 14
    with torch.no_grad():
        image_embeds = model.encode_images(processed.pixel_values, processed.grid_thws)
        embeds = model.embed_multimodal(ids, processed.pixel_values, processed.grid_thws)
        assert torch.equal(embeds[ids == MEDIA_PAD_ID], image_embeds)
        assert torch.equal(embeds[ids != MEDIA_PAD_ID], model.embed(ids)[ids != MEDIA_PAD_ID])
        generated = model.generate(ids, 4, pixel_values=processed.pixel_values, grid_thws=processed.grid_thws)
        sequence = ids
        for step in range(generated.shape[1]):  # each greedy token is the argmax of a full forward with the image
            logits = model(sequence, pixel_values=processed.pixel_values, grid_thws=processed.grid_thws)
            assert generated[0, step] == logits[0, -1].argmax()
            sequence = torch.cat([sequence, generated[:, step : step + 1]], dim=1)
        other = K3ImageProcessor.from_folder(tiny_k3)([_image(61, 45, 7), _image(30, 100, 8)])
        plain = model(ids, pixel_values=other.pixel_values, grid_thws=other.grid_thws)[0, -1]
        assert not torch.allclose(
            plain, model(ids, pixel_values=processed.pixel_values, grid_thws=processed.grid_thws)[0, -1]
        )  # the image matters


def test_image_placeholder_count_mismatches_are_clear(tiny_k3):
    model = K3ForCausalLM.from_pretrained(tiny_k3, torch_dtype=torch.float32)
    tokenizer, processed, ids = _prompt(tiny_k3, [_image(40, 40, 2)])
    with pytest.raises(ValueError, match="tokens but the images give 4 embeddings"):
        model(
            ids[:, :-3].clone().fill_(MEDIA_PAD_ID), pixel_values=processed.pixel_values, grid_thws=processed.grid_thws
        )
    with pytest.raises(ValueError, match="1 image placeholders but 2 images"):
        tokenizer.expand_images(
            tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"}]}]),
            [4, 4],
            [(40, 40), (40, 40)],
        )
