"""PTX shared by the MXFP4 tensor-core paths (`triton_pairs.pair_matmul`, `gluon_kernels`): eight E2M1 codes
widened to four bf16 pairs in about two integer operations per code.

`WIDEN_CODES` takes the four bytes of a 32-bit word in `$4` and leaves in `a` `b` the low codes of bytes (0, 1) and
(2, 3), in `c` `d` their high codes, each a bf16 pair (first element in the low half) holding the code's E2M1 value.
prmt orders the bytes b0 b2 b1 b3, so that the low codes of b0 and b1 sit 16 bits apart (likewise b2/b3, and the
high codes); an AND isolates two codes, one multiply copies each to its magnitude (bits 6-8) and sign (bit 15)
positions, an AND keeps those: the bf16 value E2M1 * 2^-126 (code 1 lands on the bf16 subnormal 2^-127), then
* 2^126 (0x7E80). Declares `t u a b c d k`; the caller's asm block wraps it in braces and writes its outputs.

`PLACE_CODES` is the same without the final multiply (a, b, c, d hold E2M1 * 2^-126, declares `t u a b c d`), for
callers that fold 2^126 into another multiply."""

PLACE_CODES = """
.reg .b32 t, u, a, b, c, d;
prmt.b32 t, $4, 0, 0x3120;
shr.u32 u, t, 8;
and.b32 a, t, 0x000F000F;
and.b32 b, u, 0x000F000F;
and.b32 c, t, 0x00F000F0;
and.b32 d, u, 0x00F000F0;
mul.lo.u32 a, a, 4160;
mul.lo.u32 b, b, 4160;
mul.lo.u32 c, c, 260;
mul.lo.u32 d, d, 260;
and.b32 a, a, 0x81C081C0;
and.b32 b, b, 0x81C081C0;
and.b32 c, c, 0x81C081C0;
and.b32 d, d, 0x81C081C0;
"""

WIDEN_CODES = (
    PLACE_CODES
    + """.reg .b32 k;
mov.b32 k, 0x7E807E80;
mul.rn.bf16x2 a, a, k;
mul.rn.bf16x2 b, b, k;
mul.rn.bf16x2 c, c, k;
mul.rn.bf16x2 d, d, k;
"""
)
