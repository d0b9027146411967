"""The MXFP4 format (OCP Microscaling Formats v1.0): blocks of 32 values along the input dimension share one E8M0 scale
(a power of two, bias 127, 0xFF = NaN); each value is FP4 E2M1 (sign, 2 exponent bits, 1 mantissa bit:
0, 0.5, 1, 1.5, 2, 3, 4, 6), two per byte with the even element in the low nibble.

Conversion follows the spec: the shared exponent is floor(log2(max |v|)) - 2 (2 = E2M1's largest exponent), each
value v / 2^shared is rounded to the nearest E2M1 value with ties to even and saturated at +-6. A block holding a
NaN or an infinity gets the NaN scale, so all of it decodes to NaN. A weight whose input width is not a multiple
of 32 is zero-padded to one.

This module imports nothing else of h3gen, so the kernels and the quantized linears can both build on it.
"""

import torch

BLOCK = 32
SCALE_BIAS = 127
SCALE_NAN = 255
E2M1_MAX = 6.0
# Magnitudes of the 8 E2M1 codes, and the midpoints between neighbours (ties resolved to the even code).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def padded_width(k: int) -> int:
    """Input width rounded up to whole 32-element blocks."""
    return -(-k // BLOCK) * BLOCK


CHUNK_ELEMENTS = 1 << 20  # rows are converted in chunks of about this many values, bounding the float64 scratch


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[N, K]` float weight -> (`[N, Kp / 2]` uint8 packed E2M1, `[N, Kp / 32]` uint8 E8M0 scales), Kp = K padded to
    a multiple of 32. Computed in float64 on the weight's device, a chunk of rows at a time."""
    if weight.ndim != 2:
        raise ValueError(f"quantize expects a [N, K] weight, got shape {tuple(weight.shape)}.")
    rows = max(1, CHUNK_ELEMENTS // max(1, weight.shape[1]))
    if weight.shape[0] > rows:
        parts = [_quantize_rows(weight[start : start + rows]) for start in range(0, weight.shape[0], rows)]
        return torch.cat([p for p, _ in parts]), torch.cat([s for _, s in parts])
    return _quantize_rows(weight)


def _quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = weight.shape
    w = weight.detach().to(torch.float64)
    if padded_width(k) != k:
        w = torch.nn.functional.pad(w, (0, padded_width(k) - k))
    blocks = w.view(n, -1, BLOCK)
    finite = torch.isfinite(blocks).all(dim=-1)
    amax = torch.where(torch.isfinite(blocks), blocks.abs(), torch.zeros_like(blocks)).amax(dim=-1)
    exponent = torch.where(
        amax > 0, torch.floor(torch.log2(amax.clamp_min(1e-300))) - 2, torch.full_like(amax, -SCALE_BIAS)
    )
    exponent = exponent.clamp(-SCALE_BIAS, SCALE_BIAS)
    scaled = blocks / torch.exp2(exponent)[..., None]
    magnitude = scaled.abs().clamp(max=E2M1_MAX)
    midpoints = torch.tensor(_MIDPOINTS, dtype=torch.float64, device=w.device)
    code = torch.searchsorted(midpoints, magnitude.contiguous(), side="left")
    tie = magnitude == midpoints[code.clamp(max=len(_MIDPOINTS) - 1)]
    code = torch.where(tie & (code % 2 == 1), code + 1, code)  # a tie goes to the even code
    code = code | torch.where(torch.signbit(scaled), 8, 0)
    code = torch.where(finite[..., None], code, torch.zeros_like(code)).to(torch.uint8).view(n, -1)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    scales = torch.where(finite, exponent + SCALE_BIAS, torch.full_like(exponent, SCALE_NAN)).to(torch.uint8)
    return packed.contiguous(), scales.contiguous()


def e2m1_lut(dtype: torch.dtype, device) -> torch.Tensor:
    """The 16 code values (sign in bit 3) as a lookup table."""
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([values, -values]).to(dtype)


def dequantize(
    packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32, in_features: int | None = None
) -> torch.Tensor:
    """(`[N, Kp / 2]` packed, `[N, Kp / 32]` scales) -> `[N, in_features or Kp]` in `dtype` (exact in float32)."""
    n = packed.shape[0]
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).view(n, -1).long()
    values = e2m1_lut(torch.float32, packed.device)[codes].view(n, -1, BLOCK)
    exponent = scales.to(torch.float32) - SCALE_BIAS
    scale = torch.where(scales == SCALE_NAN, torch.full_like(exponent, float("nan")), torch.exp2(exponent))
    weight = (values * scale[..., None]).view(n, -1)
    if in_features is not None:
        weight = weight[:, :in_features]
    return weight.to(dtype)
