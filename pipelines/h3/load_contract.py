"""What a model will sample with once loaded, read from file headers before any weight loads: a FastH3 student's
contract (`fasth3.py`; from the checkpoint, or from a FastH3 adapter merged at load, `fasth3_adapter.py`) and the
few-step recipes of the other adapters merged with it. The CLI checks its request against it before loading; a server
checks the requests queued while its model loads."""

from pathlib import Path

from h3gen.pipelines.h3.fasth3 import StudentContract
from h3gen.pipelines.h3.fasth3_adapter import split_load_time_loras
from h3gen.pipelines.h3.lora_formats import read_lora
from h3gen.pipelines.h3.recipes import Recipe, recipe_for
from h3gen.pipelines.h3.request import checkpoint_shifts, checkpoint_student


def load_time_contract(checkpoint, merge_loras, head_dim: int) -> tuple[StudentContract | None, list[Recipe]]:
    """The student contract of `checkpoint` (an `H3Checkpoint`) loaded with `merge_loras` (`from_pretrained`'s
    `loras`: a FastH3 adapter's, else the checkpoint's own, else None) and the recipes of the other merged adapters
    (`head_dim`: the transformer's, to read their layouts)."""
    adapter, others = split_load_time_loras(merge_loras)
    recipes = []
    for path, _ in others:
        recipe = recipe_for(Path(path).name, read_lora(path, head_dim=head_dim).metadata)
        recipes += [recipe] if recipe else []
    if adapter is not None:
        return adapter.contract(*checkpoint_shifts(checkpoint)), recipes
    return checkpoint_student(checkpoint), recipes
