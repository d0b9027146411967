"""One 5 s 768x1344 t2va request end to end through `H3Pipeline.__call__` (random weights at released dims, built by
`random_pipeline`), MP4 written and verified, with per-stage wall times, peak GPU memory and peak host RSS; then, on
the same weights and the request's own inputs, diffusers' transformer step and video VAE decode with the error of
ours against them, the decode tiers' TFLOP/s, and the MP4 writer's presets.

Profiles:
  h200     everything resident, lossless tier (the text encoder's 51 layers stay on the GPU next to the transformer)
  fast     the same, fast tier (FP8 GEMMs in the transformer blocks and the VAE decoder)
  rtx5090  the GPU capped at 32 GiB, offload layerwise within gpu_memory 30GiB, MXFP4 transformer, text encoder
           streamed; then the same transformer resident (uncapped) for its step time
  fasth3   a FastH3 VSA student (attention gates in every block), lossless tier: its contract, 4 forwards at
           sparsity 0.9 on the DMD grid (`--forwards` is ignored); `fasth3-fast` the same in the fast tier

`--sparsity` runs each base-model request with that sparse attention (a number, or "default") after the same
request dense, on the same weights and seed, and prints the ratio.

    python benchmarks/bench_pipeline.py --profile h200 --forwards 49 8 --reference --out results/
    python benchmarks/bench_pipeline.py --profile rtx5090 --forwards 8 --out results/
    python benchmarks/bench_pipeline.py --profile fasth3 --out results/
    python benchmarks/bench_pipeline.py --profile h200 --forwards 49 --sparsity default --out results/
    python benchmarks/bench_pipeline.py --sizes tiny --device cpu --forwards 2      # runs anywhere, in seconds
    python benchmarks/bench_pipeline.py --profile h200 --forwards 49 --previews --out results/   # on, then off

With `--previews` each request runs twice on the same weights and seed: with previews (the default cadence, or
`--preview-every N`), then without; the cost of previews is the first run's total against the second's, and (from
the first run alone) the previews' own time against the rest of it: each preview waits for the forward before it and
its decode runs alone, so the two agree. `--previews on` runs only the first (a 49-forward request at 768x1344 is
about 4.5 minutes on an H200). The report (`<out>/<profile>.json`) is written after every request.

The diffusers end-to-end time is composed from the same run: text encoding (the same transformers model; diffusers
runs all 64 layers where h3gen stops at 51, so this favours diffusers), forwards x its measured step, its video VAE
decode and the audio decode.
"""

import argparse
import copy
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import matmul_peak_tflops, print_table, rel_l2, time_cuda

from h3gen.media import Mp4Writer, probe_mp4, rgb_to_yuv420
from h3gen.pipelines.h3 import decode_stages, video_decode
from h3gen.pipelines.h3.random_weights import random_pipeline
from h3gen.pipelines.h3.tiers import set_quality
from h3gen.pipelines.h3.video_decode import to_fp8_decoder

# 128 bytes: 128 text rows with the byte-level tokenizer, so the packed sequence is 37,838 rows at 768x1344.
PROMPT = (
    "A red fox trots across a snowy meadow at dawn, breath steaming, while distant church bells ring and "
    "crows call over the pines."
)[:128].ljust(128, ".")
PROFILES = {
    "h200": dict(quality="lossless"),
    "fast": dict(quality="fast"),
    "rtx5090": dict(quality="lossless", offload="layerwise", gpu_memory="30GiB", quantization="mxfp4"),
    "fasth3": dict(quality="lossless"),
    "fasth3-fast": dict(quality="fast"),
}
STUDENT_PROFILES = ("fasth3", "fasth3-fast")  # a FastH3 VSA student: its 4-forward contract, sparsity 0.9
GiB = 2**30


class RssSampler:
    """Peak resident host memory (VmRSS) sampled every 50 ms: `ru_maxrss` would count the build's transient peak."""

    def __init__(self):
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def rss() -> int:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(0.05)

    def __enter__(self):
        self.peak = self.rss()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Capture:
    """Keeps the first transformer call's keywords and the final latents of a request (for the reference runs)."""

    def __init__(self, pipe):
        self.pipe, self.kwargs, self.latents = pipe, None, None
        transformer = pipe.transformer
        original_forward = transformer.forward

        def forward(*args, **kwargs):
            if self.kwargs is None:
                self.kwargs = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in kwargs.items()}
            return original_forward(*args, **kwargs)

        transformer.forward = forward
        original_decode = decode_stages.decode_video

        def decode_video(vae, latents, **kwargs):
            self.latents = latents.clone()
            return original_decode(vae, latents, **kwargs)

        decode_stages.decode_video = decode_video


def run_request(
    pipe,
    forwards: int | None,
    out_dir: Path,
    device,
    seconds: float,
    previews: bool = False,
    preview_every=None,
    sparsity=None,
) -> dict:
    """One timed request: per-stage seconds (each denoise step separately), peak GPU memory, the MP4's check. With
    `previews` the callback takes previews (made at `preview_every`, None: the default cadence), so they are made.
    `forwards` None runs a student's contract; `sparsity` the request's sparse attention."""
    marks = {}
    step_times = []
    last = [time.perf_counter()]

    def timed(stage, step, total):
        if stage == "denoise" and step > 0:
            sync(device)
            now = time.perf_counter()
            step_times.append(now - last[0])
            last[0] = now
        elif stage == "denoise" and step == 0:
            sync(device)
            last[0] = time.perf_counter()
        marks.setdefault(stage, time.perf_counter())

    def with_previews(stage, step, total, preview=None):
        if preview is None:
            timed(stage, step, total)

    callback = with_previews if previews else timed
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    path = out_dir / f"request_{forwards}{'_sparse' if sparsity is not None else ''}.mp4"
    sync(device)
    started = time.perf_counter()
    steps = None if forwards is None else forwards + 1  # None: a student's contract
    output = pipe(
        PROMPT,
        seconds=seconds,
        num_inference_steps=steps,
        seed=0,
        callback=callback,
        output_path=path,
        preview_every=preview_every if previews else None,
        sparsity=sparsity,
    )
    sync(device)
    total = time.perf_counter() - started
    info = probe_mp4(path)
    timings = dict(output.timings)
    outside = total - timings["denoise"]
    return {
        "forwards": output.sampling["forwards"],
        "sparsity": output.sampling.get("sparsity"),
        "with_previews": previews,
        "previews": output.previews,
        "preview_s": output.preview_seconds,
        "total_s": total,
        "stages_s": timings,
        "step_s": step_times,
        "median_step_s": statistics.median(step_times),
        "outside_loop_s": outside,
        "outside_share": outside / total,
        "peak_gpu_gib": torch.cuda.max_memory_allocated(device) / GiB if device.type == "cuda" else 0.0,
        "mp4": {
            "frames": info.num_frames,
            "size": f"{info.width}x{info.height}",
            "video_s": info.video_seconds,
            "audio_s": info.audio_seconds,
            "bytes": path.stat().st_size,
        },
    }


def decoder_flops(vae, latents) -> float:
    """Multiply-adds x 2 of the ViT decoder over every (clip, tile) piece `video_decode.decode` runs."""
    starts, pad = video_decode.clip_starts(vae, latents.shape[2])
    rows, _, _ = video_decode.decode_tiles(vae, latents.shape[-2], latents.shape[-1])
    pieces = len(starts) * sum(len(row) for row in rows)
    window = vae.tokens_chunk_size + vae.token_overlap
    ys, xs = rows[0][0]
    h = len(range(*ys.indices(latents.shape[-2])))
    w = len(range(*xs.indices(latents.shape[-1])))
    tokens = window * h * w + vae.decoder.num_register_tokens + 1
    dim = vae.decoder.proj_in.out_features
    block = 2 * tokens * (4 * dim * dim + 3 * dim * 4 * dim) + 4 * tokens * tokens * dim
    return pieces * len(vae.decoder.transformer_blocks) * block


def reference_runs(pipe, capture: Capture, device, out_dir: Path, fast_decode: bool) -> dict:
    """diffusers' step and video decode on the request's inputs and weights; our decode tiers; MP4 presets."""
    from diffusers import MiniMaxH3Transformer3DModel

    results = {}
    ours_model = pipe.transformer
    # Free the text encoder: the diffusers model shares our transformer's tensors, but its activations need room.
    pipe.text_encoder.model.to("meta")
    torch.cuda.empty_cache()
    config = {k: v for k, v in ours_model.config.to_dict().items() if not k.startswith("_")}
    with torch.device("meta"):
        diffusers_model = MiniMaxH3Transformer3DModel(**config)
    missing, _ = diffusers_model.load_state_dict(ours_model.state_dict(), strict=False, assign=True)
    if missing:
        raise RuntimeError(f"diffusers' transformer misses {missing[:5]} in ours")
    ours_buffers = dict(ours_model.named_buffers())
    for name, buffer in list(diffusers_model.named_buffers()):  # computed buffers (RoPE frequencies) are not saved
        if buffer.is_meta:
            owner, _, leaf = name.rpartition(".")
            diffusers_model.get_submodule(owner)._buffers[leaf] = ours_buffers[name]
    diffusers_model = diffusers_model.to(device).eval()
    kwargs = capture.kwargs
    plain = {k: v for k, v in kwargs.items() if k not in ("adaln_tables", "step", "return_dict")}
    with torch.no_grad():
        expected = diffusers_model(**plain, return_dict=False)
        ours = ours_model(**kwargs)  # the captured call asked for a tuple
        results["step_rel_l2_video"] = rel_l2(ours[0].float(), expected[0].float())
        results["step_rel_l2_audio"] = rel_l2(ours[1].float(), expected[1].float())
        results["diffusers_step_s"] = (
            time_cuda(lambda: diffusers_model(**plain, return_dict=False), warmup=0, repeat=1) / 1000
        )
        set_quality(ours_model, "exact")
        exact = ours_model(**plain, return_dict=False)
        results["exact_step_rel_l2_video"] = rel_l2(exact[0].float(), expected[0].float())
        set_quality(ours_model, "lossless")
    diffusers_model = expected = ours = exact = None  # free the activations before the VAE runs
    torch.cuda.empty_cache()

    vae = pipe.vae
    latents = capture.latents
    from h3gen.pipelines.h3.vae import channel_stat

    z = latents * channel_stat(vae.config.latents_std, device, 5) + channel_stat(vae.config.latents_mean, device, 5)
    flops = decoder_flops(vae, z)
    peak = matmul_peak_tflops()
    results["matmul_peak_tflops"] = peak
    decodes = {}
    with torch.no_grad():
        exact = video_decode.decode(vae, z, tier="exact")
        for tier in ("exact", "lossless"):
            ms = time_cuda(lambda: video_decode.decode(vae, z, tier=tier), warmup=1, repeat=2)
            out = video_decode.decode(vae, z, tier=tier)
            decodes[tier] = {
                "s": ms / 1000,
                "tflops": flops / ms / 1e9,
                "rel_l2_vs_diffusers": rel_l2(out, exact),
                "max_abs_vs_diffusers": (out.float() - exact.float()).abs().max().item(),
            }
            del out
        if fast_decode:
            fast_vae = copy.deepcopy(vae)
            to_fp8_decoder(fast_vae)
            ms = time_cuda(lambda: video_decode.decode(fast_vae, z, tier="fast"), warmup=1, repeat=2)
            out = video_decode.decode(fast_vae, z, tier="fast")
            decodes["fast"] = {
                "s": ms / 1000,
                "tflops": flops / ms / 1e9,
                "rel_l2_vs_diffusers": rel_l2(out, exact),
                "max_abs_vs_diffusers": (out.float() - exact.float()).abs().max().item(),
            }
            del fast_vae, out
    results["video_decode"] = decodes
    results["decoder_tflop"] = flops / 1e12
    results["one_clip_vs_float32"] = one_clip_errors(vae, z)

    # The MP4 writer on these frames: x264 presets at CRF 18, frames converted on the GPU.
    from h3gen.pipelines.h3.vae import PIXEL_MEAN, PIXEL_STD

    frames = (exact.float() * channel_stat(PIXEL_STD, device, 5) + channel_stat(PIXEL_MEAN, device, 5)).clamp(0, 1)[0]
    frames = frames.permute(1, 2, 3, 0)
    audio = torch.zeros(2, round(frames.shape[0] / 24 * 32000)).numpy()
    writes = {}
    for preset in ("ultrafast", "superfast", "veryfast", "faster", "medium"):
        started = time.perf_counter()
        planes = rgb_to_yuv420(frames).cpu().numpy()
        writer = Mp4Writer(
            out_dir / f"preset_{preset}.mp4", width=frames.shape[2], height=frames.shape[1], preset=preset
        )
        writer.add_frames(planes)
        writer.add_audio(audio)
        encoded = time.perf_counter() - started
        writer.close()
        writes[preset] = {
            "encode_s": encoded,
            "with_verify_s": time.perf_counter() - started,
            "bytes": (out_dir / f"preset_{preset}.mp4").stat().st_size,
        }
        (out_dir / f"preset_{preset}.mp4").unlink()
    results["mp4_presets"] = writes
    return results


def one_clip_errors(vae, z) -> dict:
    """The first clip (7 latent frames, every tile) decoded by diffusers in float32, and the error against it of
    diffusers' bf16 decode and of ours: what bf16 rounding alone costs next to what our decode costs."""
    clip = z[:, :, :7]
    with torch.no_grad():
        reference = copy.deepcopy(vae).float()
        truth = reference.decode(clip.float(), return_dict=False)[0]
        del reference
        errors = {
            "diffusers bf16": rel_l2(video_decode.decode(vae, clip, tier="exact").float(), truth),
            "lossless": rel_l2(video_decode.decode(vae, clip, tier="lossless").float(), truth),
        }
        fast_vae = copy.deepcopy(vae)
        to_fp8_decoder(fast_vae)
        errors["fast"] = rel_l2(video_decode.decode(fast_vae, clip, tier="fast").float(), truth)
    torch.cuda.empty_cache()
    return errors


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", choices=tuple(PROFILES), default="h200")
    parser.add_argument("--forwards", type=int, nargs="+", default=[49])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--sizes", choices=("released", "tiny"), default="released")
    parser.add_argument("--device", default=None)
    parser.add_argument("--reference", action="store_true", help="diffusers' step and decode, decode tiers, presets")
    parser.add_argument("--out", type=Path, default=Path("bench_pipeline_out"))
    parser.add_argument(
        "--offload",
        choices=("none", "stage", "layerwise"),
        default=None,
        help="the profile's offload mode instead (stage: the text encoder and VAEs on the host between their stages, "
        "for a GPU that cannot hold the whole pipeline)",
    )
    parser.add_argument("--gpu-memory", dest="gpu_memory", default=None, help="with --offload layerwise: its budget")
    parser.add_argument(
        "--sparsity",
        default=None,
        help='also run each base-model request with this sparse attention (a number or "default")',
    )
    parser.add_argument(
        "--previews",
        nargs="?",
        const="both",
        choices=("both", "on"),
        default=None,
        help="each request with previews, then without (both, the default), or with previews only (on)",
    )
    parser.add_argument("--preview-every", type=int, default=None, help="with --previews: every N forwards")
    args = parser.parse_args()
    sparsity = None
    if args.sparsity is not None:
        sparsity = args.sparsity if args.sparsity == "default" else float(args.sparsity)
    student = args.profile in STUDENT_PROFILES
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    options = dict(PROFILES[args.profile])
    if args.offload is not None:
        options["offload"] = args.offload
    if args.gpu_memory is not None:
        options["gpu_memory"] = args.gpu_memory
    if args.profile == "rtx5090" and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(32 * GiB / total, device)
    report = {
        "profile": args.profile,
        "sizes": args.sizes,
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "options": options,
        "cores": os.cpu_count(),
    }
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with RssSampler() as rss:
        started = time.perf_counter()
        pipe = random_pipeline(device, sizes=args.sizes, torch_dtype=dtype, student=student, **options)
        sync(device)
        report["build_s"] = time.perf_counter() - started
        report["rss_after_build_gib"] = RssSampler.rss() / GiB
        capture = Capture(pipe)
        # Kernels compile and tune here (the sparse kernel too, at a sparsity that selects tiles).
        warm = run_request(
            pipe, None if student else 1, args.out, device, args.seconds, sparsity=0.9 if sparsity else None
        )
        report["warmup"] = {"total_s": warm["total_s"], "stages_s": warm["stages_s"]}
        rss.peak = RssSampler.rss()  # the request's peak from here on, not the build's transients
        report["requests"] = []
        runs = {None: [False], "both": [True, False], "on": [True]}[args.previews]
        for forwards in [None] if student else args.forwards:
            for previews in runs:
                request = run_request(pipe, forwards, args.out, device, args.seconds, previews, args.preview_every)
                report["requests"].append(request)
                (args.out / f"{args.profile}.json").write_text(json.dumps(report, indent=2, default=str))
                print(
                    f"{request['forwards']} forwards{' with previews' if previews else ''}: {request['total_s']:.2f} s"
                    + (f", {request['previews']} previews {request['preview_s']:.3f} s" if previews else ""),
                    file=sys.stderr,
                    flush=True,
                )
            if sparsity is not None and not student:
                sparse = run_request(pipe, forwards, args.out, device, args.seconds, sparsity=sparsity)
                report["requests"].append(sparse)
    report["peak_rss_gib"] = rss.peak / GiB
    (args.out / f"{args.profile}.json").write_text(json.dumps(report, indent=2, default=str))
    if args.profile == "rtx5090" and device.type == "cuda":
        report["resident_mxfp4_step_s"] = resident_step(pipe, capture, device, dtype, args.sizes)
    if args.reference and device.type == "cuda":
        report["reference"] = reference_runs(pipe, capture, device, args.out, fast_decode=options["quality"] != "fast")
    (args.out / f"{args.profile}.json").write_text(json.dumps(report, indent=2, default=str))
    summarize(report)


def resident_step(pipe, capture: Capture, device, dtype, sizes: str) -> float:
    """The same MXFP4 transformer fully resident (the GPU uncapped): one step on the request's inputs, seconds."""
    import json as _json

    from h3gen.pipelines.h3.random_weights import random_tensors
    from h3gen.pipelines.h3.transformer import H3Transformer
    from h3gen.pipelines.h3.transformer_config import H3TransformerConfig

    torch.cuda.set_per_process_memory_fraction(1.0, device)
    folder = Path(pipe.checkpoint.folder("transformer"))
    config = H3TransformerConfig.from_dict(_json.loads((folder / "config.json").read_text()))
    pipe.transformer = None
    torch.cuda.empty_cache()
    resident = H3Transformer.from_pretrained(
        folder, torch_dtype=dtype, device=device, quantization="mxfp4", tensors=random_tensors(config, dtype=dtype)
    )
    from h3gen.pipelines.h3.tiers import set_quality

    set_quality(resident, "lossless")
    kwargs = dict(capture.kwargs)
    kwargs["adaln_tables"] = resident.precompute_adaln([kwargs["timestep"]])
    kwargs["step"] = 0
    with torch.no_grad():
        return time_cuda(lambda: resident(**kwargs), warmup=1, repeat=2) / 1000


def preview_cost(requests: list[dict]) -> list[dict]:
    """Per forward count run with previews: their number and own seconds, the totals with and without them, and the
    cost: the previews' own time against the rest of the run with them, and the two totals' ratio."""
    rows = []
    for forwards in dict.fromkeys(request["forwards"] for request in requests):
        runs = [request for request in requests if request["forwards"] == forwards]
        on = next((request for request in runs if request["with_previews"]), None)
        if on is None:
            continue
        off = [request["total_s"] for request in runs if not request["with_previews"]]
        mean_off = statistics.mean(off) if off else None
        rows.append(
            {
                "forwards": forwards,
                "previews": on["previews"],
                "preview_s": f"{on['preview_s']:.3f}",
                "on_s": f"{on['total_s']:.3f}",
                "off_s": f"{mean_off:.3f}" if mean_off else "",
                "own_cost": f"{on['preview_s'] / (on['total_s'] - on['preview_s']):.2%}",
                "on_vs_off": f"{on['total_s'] / mean_off - 1:+.2%}" if mean_off else "",
            }
        )
    return rows


def summarize(report: dict) -> None:
    rows = []
    for request in report["requests"]:
        if request.get("sparsity") and any(request["sparsity"]):
            ran = sum(1 for value in request["sparsity"] if value > 0)
            request["forwards"] = f"{request['forwards']} ({ran} sparse)"
        stages = request["stages_s"]
        label = f"{request['forwards']} +previews" if request["with_previews"] else request["forwards"]
        for stage, seconds in stages.items():
            rows.append(
                {
                    "forwards": label,
                    "stage": stage,
                    "s": f"{seconds:.3f}",
                    "share": f"{seconds / request['total_s']:.1%}",
                }
            )
        rows.append({"forwards": label, "stage": "median step", "s": f"{request['median_step_s']:.3f}"})
        rows.append(
            {
                "forwards": label,
                "stage": "outside the loop",
                "s": f"{request['outside_loop_s']:.3f}",
                "share": f"{request['outside_share']:.1%}",
            }
        )
        rows.append(
            {
                "forwards": label,
                "stage": "total",
                "s": f"{request['total_s']:.3f}",
                "share": f"peak GPU {request['peak_gpu_gib']:.1f} GiB",
            }
        )
    print(
        f"profile {report['profile']} ({report['gpu']}), build {report['build_s']:.1f} s, "
        f"peak host RSS {report['peak_rss_gib']:.1f} GiB"
    )
    print_table(rows, ["forwards", "stage", "s", "share"])
    preview_rows = preview_cost(report["requests"])
    if preview_rows:
        print("previews: their own time against the rest of the run with them, and that run against the one without")
        print_table(preview_rows, ["forwards", "previews", "preview_s", "on_s", "off_s", "own_cost", "on_vs_off"])
    if "resident_mxfp4_step_s" in report:
        offloaded = report["requests"][0]["median_step_s"]
        print(
            f"offloaded step {offloaded:.3f} s vs resident MXFP4 step {report['resident_mxfp4_step_s']:.3f} s: "
            f"{offloaded / report['resident_mxfp4_step_s']:.3f}x"
        )
    dense = {r["forwards"]: r for r in report["requests"] if not (r.get("sparsity") and any(r["sparsity"]))}
    for request in report["requests"]:
        forwards = request["forwards"]
        if isinstance(forwards, str) and int(forwards.split()[0]) in dense:
            base = dense[int(forwards.split()[0])]
            print(
                f"{forwards}: {request['total_s']:.1f} s vs dense {base['total_s']:.1f} s: "
                f"{base['total_s'] / request['total_s']:.3f}x (median step {request['median_step_s']:.3f} vs "
                f"{base['median_step_s']:.3f} s)"
            )
    reference = report.get("reference")
    if reference:
        print(
            f"diffusers step {reference['diffusers_step_s']:.3f} s; ours (lossless) vs diffusers rel L2 video "
            f"{reference['step_rel_l2_video']:.2e} audio {reference['step_rel_l2_audio']:.2e}; ours (exact) "
            f"{reference['exact_step_rel_l2_video']:.2e}"
        )
        print(
            "one clip's decode against diffusers' float32 decode (rel L2): "
            + ", ".join(f"{k} {v:.2e}" for k, v in reference["one_clip_vs_float32"].items())
        )
        decode_rows = [
            {"tier": tier, **{k: (f"{v:.3g}" if isinstance(v, float) else v) for k, v in d.items()}}
            for tier, d in reference["video_decode"].items()
        ]
        print(
            f"video decode: {reference['decoder_tflop']:.0f} TFLOP, matmul peak "
            f"{reference['matmul_peak_tflops']:.0f} TFLOP/s"
        )
        print_table(decode_rows, ["tier", "s", "tflops", "rel_l2_vs_diffusers", "max_abs_vs_diffusers"])
        print_table(
            [
                {"preset": p, **{k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in d.items()}}
                for p, d in reference["mp4_presets"].items()
            ],
            ["preset", "encode_s", "with_verify_s", "bytes"],
        )
        for request in report["requests"]:
            stages = request["stages_s"]
            composed = (
                stages["encode_text"]
                + stages.get("encode_conditions", 0.0)
                + request["forwards"] * reference["diffusers_step_s"]
                + reference["video_decode"]["exact"]["s"]
                + stages["decode_audio"]
            )
            print(
                f"{request['forwards']} forwards: diffusers composed {composed:.1f} s vs ours "
                f"{request['total_s']:.1f} s (MP4 written and verified): {composed / request['total_s']:.3f}x"
            )


if __name__ == "__main__":
    main()
