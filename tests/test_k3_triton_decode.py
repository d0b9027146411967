"""The tiny K3 decoded through the Triton kernels (on the CPU under TRITON_INTERPRET=1, on a GPU natively) gives
the torch path's logits. Each kernel alone: tests/kernels/."""

import pytest
import torch
from helpers.kernel_cases import DEVICE
from helpers.kernel_cases import err as _err

from h3gen.kernels.gemv import triton as gemv_triton

# K3 decode through the Triton interpreter: outside the fast tier.
pytestmark = pytest.mark.slow


def _prefill_and_decode(model, monkeypatch, triton: str) -> torch.Tensor:
    """Logits `[3, vocab]` of a five-token prefill and two greedy decode steps, with `H3GEN_TRITON=triton`; each
    step's argmax as the model returns it with its logits (on the Triton path, found by lm_head's kernel) is the
    logits' argmax."""
    monkeypatch.setenv("H3GEN_TRITON", triton)
    cache = model.new_cache()
    logits = [model(torch.tensor([[3, 7, 11, 5, 9]], device=DEVICE), cache)[:, -1]]
    for _ in range(2):
        step, argmax = model(logits[-1].argmax(-1)[:, None], cache, with_argmax=True)
        assert argmax.shape == (1, 1) and torch.equal(argmax, step.argmax(-1))
        logits.append(step[:, -1])
    return torch.cat(logits)


@pytest.mark.gpu
def test_tiny_decode_through_the_triton_kernels_matches_torch(monkeypatch):
    """The tiny K3 (residual stream, stacked experts with the shared one riding as expert E, fused projections)
    prefilled and decoded two steps on the Triton kernels gives the torch path's logits; a decode step's norms are
    computed in its projections' kernels (`normed_rows_linear`: with a residual add into every layer's input
    projection, the dense MLP's and lm_head; without one for the embeddings and MLA's q_a)."""
    import dataclasses

    from h3gen.pipelines.k3.config import K3Config
    from h3gen.pipelines.k3.demo_model import randomize, tiny_config
    from h3gen.pipelines.k3.engine.graphs import prepare_for_decode
    from h3gen.pipelines.k3.model import K3ForCausalLM

    config = dataclasses.replace(K3Config.from_dict(tiny_config()), experts_mxfp4=False, attn_res_block_size=0)
    with torch.device("meta"):
        model = K3ForCausalLM(config)
    model = randomize(model.to_empty(device=DEVICE), seed=5).float().eval()
    prepare_for_decode(model)
    normed_calls = []
    kernel = gemv_triton.normed_rows_linear
    monkeypatch.setattr(
        gemv_triton,
        "normed_rows_linear",
        lambda *args, **kw: normed_calls.append(args[4] is not None) or kernel(*args, **kw),
    )

    with torch.no_grad():
        expected = _prefill_and_decode(model, monkeypatch, "0")
        assert not normed_calls
        got = _prefill_and_decode(model, monkeypatch, "1")
    assert _err(got, expected) <= 1e-5
    layers = config.num_hidden_layers
    mla = config.attention_types.count("mla")
    # per decode step: the layers' ends (into the next input projection or lm_head) and the dense layer's
    # post-attention norm with a residual; the embeddings' norm and each MLA layer's q_a norm without
    assert normed_calls.count(True) == 2 * (layers + config.ffn_types.count("dense"))
    assert normed_calls.count(False) == 2 * (1 + mla)


@pytest.mark.gpu
def test_silu_model_decode_through_the_triton_kernels_matches_torch(monkeypatch):
    """A tiny K3 with SwiGLU experts at full width (the mid-size benchmark's kind: the shared expert rides in the
    stack; the ids' embeddings come from the embedding kernel) prefilled and decoded two steps on the Triton
    kernels gives the torch path's logits."""
    import dataclasses

    from h3gen.kernels.embedding import triton as emb_triton
    from h3gen.pipelines.k3.config import K3Config
    from h3gen.pipelines.k3.demo_model import randomize, tiny_config
    from h3gen.pipelines.k3.engine.graphs import prepare_for_decode
    from h3gen.pipelines.k3.model import K3ForCausalLM

    config = dataclasses.replace(
        K3Config.from_dict(tiny_config()),
        experts_mxfp4=False,
        attn_res_block_size=0,
        hidden_act="silu",
        routed_expert_hidden_size=None,
        latent_moe_use_norm=False,
    )
    with torch.device("meta"):
        model = K3ForCausalLM(config)
    model = randomize(model.to_empty(device=DEVICE), seed=6).float().eval()
    prepare_for_decode(model)
    calls = []
    for module, name in ((emb_triton, "embedding_rows"),):
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _k=kernel, _n=name, **kw: calls.append(_n) or _k(*a, **kw))

    with torch.no_grad():
        expected = _prefill_and_decode(model, monkeypatch, "0")
        assert not calls
        got = _prefill_and_decode(model, monkeypatch, "1")
    assert _err(got, expected) <= 1e-5
    assert calls == ["embedding_rows"] * 3  # the prompt's five ids and each step's one
