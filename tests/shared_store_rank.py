"""One local rank of the shared-host-store test (run as a subprocess by test_offload.py): loads the transformer at
argv[1] (a reader rank skips the blocks), offloads it through a store in argv[2], runs argv[4] inputs and saves
the outputs and what it loaded to argv[3]."""

import dataclasses
import sys

import torch
from helpers.h3_tiny import random_inputs

from h3gen.offload import SharedHostStore, apply_layerwise_offload
from h3gen.pipelines.h3.tiers import set_quality
from h3gen.pipelines.h3.transformer import H3Transformer

folder, directory, out, budget = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
store = SharedHostStore("test-store", directory=directory, timeout=120)
model = H3Transformer.from_pretrained(
    folder, torch_dtype=torch.float32, skip_prefixes=() if store.owner else ("transformer_blocks.",)
)
loaded_blocks = all(p.device.type != "meta" for p in model.transformer_blocks.parameters())
set_quality(model, "lossless")
model.eval()
offload = apply_layerwise_offload(model, "cpu", gpu_memory=budget, activation_reserve=0, prefetch=1, host_store=store)
outputs = []
for step in range(2):
    inputs = random_inputs(
        dataclasses.asdict(model.config),
        seed=step,
        num_text=6,
        latent_frames=3,
        latent_hw=(4, 2),
        audio_latents=7,
        anchors=("first",),
        distinct_timesteps=3,
    )
    with torch.no_grad():
        got = model(**inputs, return_dict=False, adaln_tables=model.precompute_adaln([inputs["timestep"]]), step=0)
    outputs.append([t.clone() for t in got])
torch.save(
    {
        "outputs": outputs,
        "loaded_blocks": loaded_blocks,
        "resident": model.offload_plan.resident,
        "store_bytes": offload.pinned_bytes,
    },
    out,
)
