"""The K3 engine: Kimi K3 / Kimi-Linear text model (KDA + gated MLA, LatentMoE with SiTU, MXFP4 experts, block
Attention Residuals), its loader, per-request state, tokenizer and a tiny random checkpoint."""

from h3gen.pipelines.k3.config import K3Config
from h3gen.pipelines.k3.model import K3ForCausalLM

__all__ = ["K3Config", "K3ForCausalLM"]
