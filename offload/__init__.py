"""Layer-wise host offload (`h3gen.offload`). The unit is one transformer block (`H3TransformerBlock`)."""
