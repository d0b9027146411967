"""FastH3: FastVideo's 4-forward DMD2 students of MiniMax-H3, and the sampling contract a student checkpoint runs.

A student checkpoint has the diffusers layout of the base model. A VSA student adds one attention gate per block
(`transformer_blocks.{i}.attn.to_gate_compress.weight`, [heads * head_dim, hidden]) and was trained with VSA-H3
sparse attention at sparsity 0.9 on every forward and block; the dense student has no gates. A root
`fastvideo_inference.json` (schema "fasth3-inference-contract-v1") records the contract: task "t2av", 4 transformer
forwards on the DMD positions `dmd_denoising_steps` / 1000 ([999, 749, 500, 250] -> 0.999, 0.749, 0.5, 0.25, then
0), guidance 1 (H3 runs one forward per step, so there is no second branch), `attention_backend`
"VIDEO_SPARSE_ATTN_H3" with `vsa_sparsity` (0.9) and `vsa_tile_size` (64). The per-modality shifts (12 video, 3
audio) come from the checkpoint's scheduler configs and are applied on top of the positions. A checkpoint with gates
and no contract file runs the published contract (FastVideo `FastVideo-FastH3-4-step-Preview-v1-VSA-DataFree`;
SGLang's `FastH3SamplingParams` and vLLM-Omni's `fasth3.py` pin the same values).
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from h3gen.errors import CheckpointError
from h3gen.loading.files import safetensors_files
from h3gen.pipelines.h3.recipes import Recipe

GATE_SUFFIX = ".attn.to_gate_compress.weight"  # a VSA student's gates: `transformer_blocks.{i}` + this
CONTRACT_FILE = "fastvideo_inference.json"
CONTRACT_SCHEMA = "fasth3-inference-contract-v1"
DMD_STEPS = (999, 749, 500, 250)  # the DMD rungs on the 1000-step training clock
VSA_SPARSITY = 0.9
VSA_BACKEND = "VIDEO_SPARSE_ATTN_H3"
VSA_TILE_ROWS = 64


@dataclass(frozen=True)
class StudentContract:
    """How a FastH3 student samples: its `recipe` (forwards, shifts, base positions, tasks) and the VSA-H3 sparsity
    of every forward (`sparsity`, None for the dense student)."""

    recipe: Recipe
    sparsity: float | None

    @property
    def gated(self) -> bool:
        return self.sparsity is not None

    def describe(self) -> dict:
        """A JSON-able summary (the server's /health, job status)."""
        return self.recipe.describe() | {"sparsity": self.sparsity}


def student_recipe(steps: tuple[int, ...], video_shift: float, audio_shift: float, gated: bool) -> Recipe:
    """The recipe of a student distilled on the DMD rungs `steps` (e.g. (999, 749, 500, 250)): one forward per rung,
    base positions rung / 1000 then 0, shifted per modality, t2va only."""
    base = tuple(step / 1000 for step in steps) + (0.0,)
    kind = "VSA" if gated else "dense"
    return Recipe(f"FastH3 {len(steps)}-step ({kind})", len(steps), video_shift, audio_shift, ("t2va",), base)


def has_gates(folder) -> bool:
    """True when the transformer checkpoint in `folder` holds VSA gates (read from the safetensors headers)."""
    for path, keys in safetensors_files(Path(folder)).items():
        if keys is None:
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                keys = list(handle.keys())
        if any(key.endswith(GATE_SUFFIX) for key in keys):
            return True
    return False


def read_student_contract(root: Path, *, gated: bool, video_shift: float, audio_shift: float) -> StudentContract | None:
    """The contract of the checkpoint at `root`: from its `fastvideo_inference.json` when present, else the published
    VSA contract when the transformer has gates (`gated`), else None (not a student). Raises `CheckpointError` for a
    contract file h3gen cannot run (another schema, task or backend, or a VSA contract without gates)."""
    path = Path(root) / CONTRACT_FILE
    if not path.exists():
        if not gated:
            return None
        return StudentContract(student_recipe(DMD_STEPS, video_shift, audio_shift, True), VSA_SPARSITY)
    try:
        contract = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{CONTRACT_FILE} of this model is not readable JSON ({error}).") from None
    if not isinstance(contract, dict) or contract.get("schema_version") != CONTRACT_SCHEMA:
        raise CheckpointError(f"{CONTRACT_FILE} of this model is not a {CONTRACT_SCHEMA} contract.")
    if contract.get("task", "t2av") not in ("t2av", "t2va"):
        raise CheckpointError(f"{CONTRACT_FILE} names task {contract.get('task')!r}; h3gen runs FastH3 t2va only.")
    steps = contract.get("dmd_denoising_steps", list(DMD_STEPS))
    forwards = contract.get("transformer_forwards", len(steps))
    if (
        not isinstance(steps, list)
        or not steps
        or not all(isinstance(s, int) and 0 < s <= 1000 for s in steps)
        or any(a <= b for a, b in zip(steps, steps[1:], strict=False))
        or forwards != len(steps)
    ):
        raise CheckpointError(
            f"{CONTRACT_FILE}: dmd_denoising_steps must be decreasing rungs in 1..1000, one per transformer forward "
            f"(got {steps!r} for {forwards!r} forwards)."
        )
    if float(contract.get("guidance_scale", 1.0)) != 1.0:
        raise CheckpointError(f"{CONTRACT_FILE}: guidance_scale {contract['guidance_scale']} (FastH3 runs at 1).")
    backend = contract.get("attention_backend", VSA_BACKEND if gated else None)
    sparsity = None
    if backend == VSA_BACKEND:
        if not gated:
            raise CheckpointError(
                f"{CONTRACT_FILE} asks for VSA-H3 attention but the transformer has no to_gate_compress weights: "
                "this folder mixes a VSA contract with a dense student's weights."
            )
        if int(contract.get("vsa_tile_size", VSA_TILE_ROWS)) != VSA_TILE_ROWS:
            raise CheckpointError(f"{CONTRACT_FILE}: vsa_tile_size {contract['vsa_tile_size']} (h3gen runs 64).")
        sparsity = float(contract.get("vsa_sparsity", VSA_SPARSITY))
        if not (math.isfinite(sparsity) and 0.0 <= sparsity < 1.0):
            raise CheckpointError(f"{CONTRACT_FILE}: vsa_sparsity {sparsity} is outside [0, 1).")
    elif gated:
        raise CheckpointError(
            f"{CONTRACT_FILE} asks for {backend!r} attention but the transformer has VSA gates: a VSA student runs "
            f"{VSA_BACKEND} only."
        )
    recipe = student_recipe(tuple(steps), video_shift, audio_shift, gated)
    return StudentContract(recipe, sparsity)
