"""The batched video VAE decode (`video_decode.decode`) against diffusers' own `AutoencoderKLMiniMaxH3.decode`:
same clips, tiles and cross-fades, on odd latent sizes, with and without tiling, any batch size."""

import copy

import pytest
import torch

from h3gen.pipelines.h3 import video_decode
from h3gen.pipelines.h3.tiny_checkpoint import VIDEO_VAE


@pytest.fixture(scope="module")
def vae():
    from diffusers import AutoencoderKLMiniMaxH3

    torch.manual_seed(0)
    model = AutoencoderKLMiniMaxH3(**{**VIDEO_VAE, "decoder_num_layers": 2}).eval().requires_grad_(False)
    for param in model.decoder.parameters():  # the class initialises the layer scales to zero: make blocks count
        param.data.normal_(0.0, 0.1)
    return model


def _rel(actual, expected):
    return ((actual - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize(
    "latent_shape,batch", [((37, 4, 6), 3), ((12, 20, 24), 5), ((7, 17, 33), 1), ((17, 18, 16), 64)]
)
def test_lossless_decode_equals_diffusers(vae, latent_shape, batch):
    z = torch.randn(1, 24, *latent_shape, generator=torch.Generator().manual_seed(sum(latent_shape)))
    expected = vae.decode(z).sample
    got = video_decode.decode(vae, z, tier="lossless", batch=batch)
    assert got.shape == expected.shape
    assert _rel(got, expected) < 1e-6


def test_without_tiling_and_exact_tier(vae):
    z = torch.randn(1, 24, 12, 5, 7, generator=torch.Generator().manual_seed(3))
    untiled = copy.deepcopy(vae)
    untiled.disable_tiling()
    assert _rel(video_decode.decode(untiled, z, tier="lossless"), untiled.decode(z).sample) < 1e-6
    assert torch.equal(video_decode.decode(vae, z, tier="exact"), vae.decode(z).sample)


def test_fast_decode_is_close_and_checks_before_each_block(vae):
    z = torch.randn(1, 24, 12, 20, 24, generator=torch.Generator().manual_seed(4))
    fast = copy.deepcopy(vae)
    video_decode.to_fp8_decoder(fast)
    video_decode.to_fp8_decoder(fast)  # converting twice is a no-op
    calls = []
    got = video_decode.decode(fast, z, tier="fast", batch=7, check=lambda: calls.append(1))
    assert _rel(got, vae.decode(z).sample) < 2e-2
    starts, _ = video_decode.clip_starts(fast, z.shape[2])
    rows, _, _ = video_decode.decode_tiles(fast, z.shape[-2], z.shape[-1])
    pieces = len(starts) * sum(len(row) for row in rows)
    assert len(calls) == -(-pieces // 7) * len(fast.decoder.transformer_blocks)


def test_a_check_that_raises_stops_the_decode(vae):
    z = torch.randn(1, 24, 7, 4, 6)

    def cancel():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        video_decode.decode(vae, z, tier="lossless", check=cancel)
