"""Quantized weights and the linears that use them (`fp8` for the fast tier)."""
