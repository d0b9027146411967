"""`x W^T + h U^T` (a linear with its LoRA update in the GEMM's K loop), Triton on CUDA."""
