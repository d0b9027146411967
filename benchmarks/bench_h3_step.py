"""A MiniMax-H3 denoising step at released dims: diffusers' `MiniMaxH3Transformer3DModel` against our
`H3Transformer` (exact and lossless tiers) with N full-size blocks, on one 5 s 768x1344 t2va packed sequence
(37,838 rows) or a shorter one. The step overhead (embedders, token refiner, norm_out, heads) is measured with no
blocks; the 50-block step is estimated as overhead + 50 x the per-block time.

    python benchmarks/bench_h3_step.py --layers 4 --rows 37838
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, rel_l2, time_cuda

from h3gen.pipelines.h3.packing import build_layout, row_timesteps
from h3gen.pipelines.h3.tiers import set_quality
from h3gen.pipelines.h3.transformer import H3Transformer
from h3gen.pipelines.h3.transformer_config import KEEP_FP32_MODULES, H3TransformerConfig

TEXT_ROWS = 128


def cast_with_islands(model, dtype):
    for name, param in model.named_parameters():
        keep = any(part in KEEP_FP32_MODULES for part in name.split("."))
        param.data = param.data.to(torch.float32 if keep else dtype)
    return model


def inputs(rows: int, config: H3TransformerConfig, device, text_rows: int = TEXT_ROWS, audio_rows: int = 414):
    """A t2va layout at 768x1344 (37 latent frames, 207 audio latents, 128 text rows), cut to `rows` video rows
    (`text_rows` / `audio_rows` for a smaller layout of the same shape)."""
    layout = build_layout(text_rows, 37, 48, 84, audio_rows // 2)
    video_rows = rows - text_rows - audio_rows
    if video_rows < 1:
        raise SystemExit(f"--rows must exceed {text_rows + audio_rows}")
    keep = torch.arange(text_rows + audio_rows + video_rows)
    tags = layout.token_tags[keep]
    timestep, indices = row_timesteps(layout, 0.37, 0.61, 0.999)
    g = torch.Generator(device=device).manual_seed(0)
    return dict(
        hidden_states=torch.randn(1, video_rows, config.video_patch_dim, device=device, generator=g),
        audio_hidden_states=torch.randn(1, audio_rows, config.audio_in_channels, device=device, generator=g),
        encoder_hidden_states=torch.randn(1, text_rows, config.text_dim, device=device, generator=g).bfloat16(),
        timestep=timestep.to(device),
        timestep_indices=indices[keep].to(device),
        token_tags=tags.to(device),
        position_ids=layout.position_ids[keep].to(device),
        video_indices=torch.arange(text_rows + audio_rows, text_rows + audio_rows + video_rows, device=device),
        audio_indices=layout.audio_indices.to(device),
        text_indices=layout.text_indices.to(device),
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, nargs="+", default=[37838])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from diffusers import MiniMaxH3Transformer3DModel

    device = torch.device("cuda")
    rows_out = []
    for layers in (0, args.layers):
        config = H3TransformerConfig(num_layers=layers)
        torch.manual_seed(0)
        reference = MiniMaxH3Transformer3DModel(**{k: v for k, v in config.to_dict().items() if not k.startswith("_")})
        reference = cast_with_islands(reference, torch.bfloat16).to(device).eval()
        ours = cast_with_islands(H3Transformer(config), torch.bfloat16).to(device).eval()
        ours.load_state_dict(reference.state_dict())
        for rows in args.rows:
            kwargs = inputs(rows, config, device)
            with torch.no_grad():
                expected = reference(**kwargs, return_dict=False)[0]
                variants = {"diffusers eager": lambda: reference(**kwargs, return_dict=False)}
                set_quality(ours, "exact")
                variants["ours exact"] = lambda: ours(**kwargs, return_dict=False)
                results = {
                    name: (time_cuda(fn, warmup=2, repeat=args.repeat), fn()[0]) for name, fn in variants.items()
                }
                set_quality(ours, "lossless")
                tables = ours.precompute_adaln([kwargs["timestep"]])

                def lossless(ours=ours, tables=tables):
                    return ours(**kwargs, return_dict=False, adaln_tables=tables, step=0)

                results["ours lossless"] = (time_cuda(lossless, warmup=2, repeat=args.repeat), lossless()[0])
            for name, (ms, out) in results.items():
                rows_out.append(
                    {
                        "layers": layers,
                        "rows": rows,
                        "variant": name,
                        "ms": ms,
                        "relL2 vs diffusers": f"{rel_l2(out, expected):.2e}",
                    }
                )
        torch.cuda.empty_cache()
    summary = []
    for row in rows_out:
        if row["layers"] == args.layers:
            overhead = next(
                r["ms"]
                for r in rows_out
                if r["layers"] == 0 and r["variant"] == row["variant"] and r["rows"] == row["rows"]
            )
            per_block = (row["ms"] - overhead) / args.layers
            summary.append(
                {
                    **row,
                    "ms": f"{row['ms']:.2f}",
                    "overhead ms": f"{overhead:.2f}",
                    "per block ms": f"{per_block:.2f}",
                    "50-block step s": f"{(overhead + 50 * per_block) / 1000:.2f}",
                }
            )
    base = {s["rows"]: float(s["50-block step s"]) for s in summary if s["variant"] == "diffusers eager"}
    for s in summary:
        s["x diffusers"] = f"{base[s['rows']] / float(s['50-block step s']):.3f}"
    if args.out:
        args.out.write_text(json.dumps({"raw": rows_out, "summary": summary}, indent=2, default=str))
    print_table(
        summary,
        [
            "layers",
            "rows",
            "variant",
            "ms",
            "overhead ms",
            "per block ms",
            "50-block step s",
            "x diffusers",
            "relL2 vs diffusers",
        ],
    )


if __name__ == "__main__":
    main()
