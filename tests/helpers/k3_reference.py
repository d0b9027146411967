"""Reference implementations the K3 tests compare against: fla-core's naive KDA functions, transformers'
Kimi-Linear model on its plain-torch path, and the top-k / top-p rule written out with torch ops.

With fla-core installed, transformers' Kimi-Linear binds fla's Triton kernels at import time, which cannot run on
a CPU; `kimi_linear_torch()` therefore imports the modeling module afresh with `fla` hidden, so it takes its own
torch functions.
"""

import importlib
import math
import sys

import torch

_MODELING = "transformers.models.kimi_linear.modeling_kimi_linear"


def kimi_linear_torch():
    """transformers' `modeling_kimi_linear` module bound to its torch fallbacks (a private copy)."""
    saved = {name: sys.modules.pop(name) for name in list(sys.modules) if name == _MODELING}
    hidden = {name: sys.modules[name] for name in list(sys.modules) if name == "fla" or name.startswith("fla.")}
    for name in hidden:
        sys.modules[name] = None
    sys.modules["fla"] = None
    try:
        module = importlib.import_module(_MODELING)
    finally:
        sys.modules.pop("fla", None)
        for name in hidden:
            sys.modules[name] = hidden[name]
        sys.modules.pop(_MODELING, None)
        sys.modules.update(saved)
    return module


def fla_naive():
    """fla-core's `fla.ops.kda.naive` (plain torch, imports on a CPU)."""
    return importlib.import_module("fla.ops.kda.naive")


def fla_gate():
    return importlib.import_module("fla.ops.kda.gate")


def max_rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a - e| / max |e| (a relative error on the scale of the tensor)."""
    return ((actual.double() - expected.double()).abs().max() / expected.double().abs().max().clamp_min(1e-30)).item()


# --- K3 vision tower, float64, written from sglang 0.5.23's kimi_vl_moonvit.py (not from our module) ---------------


def _rms64(x, weight, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _bilinear64(table, h, w):
    """`[H0, W0, D]` -> `[h, w, D]`: half-pixel centres (align_corners=False), sources clamped at 0."""

    def taps(size_in, size_out):
        out = []
        for i in range(size_out):
            src = max((i + 0.5) * size_in / size_out - 0.5, 0.0)
            lo = int(src)
            hi = min(lo + 1, size_in - 1)
            out.append((lo, hi, src - lo))
        return out

    rows, cols = taps(table.shape[0], h), taps(table.shape[1], w)
    out = torch.empty(h, w, table.shape[2], dtype=torch.float64)
    for i, (r0, r1, a) in enumerate(rows):
        for j, (c0, c1, b) in enumerate(cols):
            out[i, j] = (1 - a) * ((1 - b) * table[r0, c0] + b * table[r0, c1]) + a * (
                (1 - b) * table[r1, c0] + b * table[r1, c1]
            )
    return out


def _gelu_tanh64(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def _gelu_erf64(x):
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def vision_reference(state: dict, config, pixels: torch.Tensor, grids, norm_eps: float) -> torch.Tensor:
    """K3 vision tower + projector in float64: `state` has the checkpoint keys (`vision_tower.*`,
    `mm_projector.*`), `config` a K3VisionConfig; returns `[tokens, text hidden]`, images in order."""
    s = {k: v.double() for k, v in state.items()}
    d, heads, hd = config.vt_hidden_size, config.vt_num_attention_heads, config.head_dim
    p = config.patch_size
    outputs = []
    start = 0
    for t, h, w in grids:
        n = t * h * w
        x = (
            pixels[start : start + n].double().reshape(n, 3 * p * p)
            @ s["vision_tower.patch_embed.proj.weight"].reshape(d, -1).T
        )
        start += n
        table = s["vision_tower.patch_embed.pos_emb.weight"]
        pos = table if tuple(table.shape[:2]) == (h, w) else _bilinear64(table, h, w)
        pos = pos.reshape(h * w, d)
        omega = 10000.0 ** (-torch.arange(d // 2, dtype=torch.float64) / (d / 2))
        frames = [pos + (torch.cat([torch.sin(f * omega), torch.cos(f * omega)]) if t > 1 else 0) for f in range(t)]
        x = x + torch.cat(frames)
        # 2-D RoPE: pair 2i turns by col * f_i, pair 2i+1 by row * f_i, f_i = 10000^(-4i / hd)
        freq = 10000.0 ** (-4 * torch.arange(hd // 4, dtype=torch.float64) / hd)
        rows = torch.arange(h, dtype=torch.float64).repeat_interleave(w).repeat(t)
        cols = torch.arange(w, dtype=torch.float64).repeat(h).repeat(t)
        angle = torch.stack([cols[:, None] * freq, rows[:, None] * freq], dim=-1).reshape(n, hd // 2)
        cos, sin = torch.cos(angle)[:, None], torch.sin(angle)[:, None]

        def rotate(v, cos=cos, sin=sin):
            a, b = v[..., 0::2], v[..., 1::2]
            return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).reshape(v.shape)

        for i in range(config.vt_num_hidden_layers):
            pre = f"vision_tower.encoder.blocks.{i}."
            y = _rms64(x, s[pre + "norm0.weight"], norm_eps)
            qkv = (y @ s[pre + "wqkv.weight"].T).reshape(n, 3, heads, hd)
            q, k, v = rotate(qkv[:, 0]), rotate(qkv[:, 1]), qkv[:, 2]
            scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
            o = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v).reshape(n, heads * hd)
            x = x + o @ s[pre + "wo.weight"].T
            y = _rms64(x, s[pre + "norm1.weight"], norm_eps)
            x = x + _gelu_tanh64(y @ s[pre + "mlp.fc0.weight"].T) @ s[pre + "mlp.fc1.weight"].T
        x = _rms64(x, s["vision_tower.encoder.final_layernorm.weight"], norm_eps).reshape(t, h, w, d)
        x = x.mean(0)
        groups = [
            torch.cat([x[2 * r, 2 * c], x[2 * r, 2 * c + 1], x[2 * r + 1, 2 * c], x[2 * r + 1, 2 * c + 1]])
            for r in range(h // 2)
            for c in range(w // 2)
        ]
        outputs.append(torch.stack(groups))
    v = torch.cat(outputs)
    v = _gelu_erf64(v @ s["mm_projector.proj.0.weight"].T) @ s["mm_projector.proj.2.weight"].T
    return _rms64(v, s["mm_projector.post_norm.weight"], config.projector_ln_eps)


def hf_navit_resize():
    """transformers' Kimi-K2.5 `navit_resize` (the same resize rule as K3's `media_proc_cfg`), taken from the
    installed source: its module imports torchvision, which this environment lacks, so only the function (pure
    arithmetic on `math`) is compiled."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("transformers.models.kimi_k25")
    path = spec.submodule_search_locations[0] + "/image_processing_kimi_k25.py"
    tree = ast.parse(open(path).read())
    function = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "navit_resize")
    namespace = {"math": math}
    exec(compile(ast.Module(body=[function], type_ignores=[]), path, "exec"), namespace)
    return namespace["navit_resize"]


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """`logits` `[V]` float32 -> scaled logits with the tokens outside top-k / top-p set to -inf: the rule the
    engine's sampler draws by, written out plainly (the sampler itself never builds this row)."""
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it already does.
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop[0] = False  # never the best token
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits
