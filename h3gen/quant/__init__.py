"""Quantized weights and the linears that use them: `mxfp4_format` (the MXFP4 format itself, which imports nothing
else of h3gen so the kernels can use it too), `mxfp4` (`MXFP4Linear`) and `fp8` (the fast tier's e4m3 linears)."""
