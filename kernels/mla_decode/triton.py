"""Paged MLA decode attention in Triton: one program per (sequence, block of heads) walks the sequence's pages
through its block-table row, with an online softmax, reading each live latent row once for all its heads. The
lengths and the table are read on the device, so the kernel is CUDA-graph safe."""

import torch
import triton
import triton.language as tl

from h3gen.kernels._dispatch import next_power_of_2
from h3gen.kernels._pdl import pdl_flag, pdl_launch, wait_for_inputs


@triton.jit
def _mla_decode_kernel(
    q_ptr,
    kv_ptr,
    table_ptr,
    lens_ptr,
    out_ptr,
    lse_ptr,
    heads,
    rank,
    rope,
    scale,
    stride_qb,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_tb,
    stride_ob,
    stride_oh,
    stride_os,
    PAGE: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    SPLITS: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    wait_for_inputs(PDL)
    rs = tl.arange(0, BLOCK_R)
    ps = tl.arange(0, BLOCK_P)
    slots = tl.arange(0, BLOCK_S)  # rows per iteration: a part of one page (BLOCK_S divides PAGE)
    head_ok = hs < heads
    q_rows = q_ptr + seq * stride_qb + hs[:, None] * stride_qh
    q_latent = tl.load(q_rows + rs[None, :], mask=head_ok[:, None] & (rs[None, :] < rank), other=0.0)
    q_pe = tl.load(q_rows + rank + ps[None, :], mask=head_ok[:, None] & (ps[None, :] < rope), other=0.0)
    # Products in the cache's dtype with float32 accumulation (tensor cores for bf16 / fp16 caches); a float32 cache
    # gets exact float32 products (IEEE), not TF32.
    q_latent = q_latent.to(kv_ptr.dtype.element_ty)
    q_pe = q_pe.to(kv_ptr.dtype.element_ty)
    length = tl.load(lens_ptr + seq)
    # This program's rows: the split-th of SPLITS runs of whole BLOCK_S blocks (so no block crosses a page).
    span = tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_S) * BLOCK_S
    first = split * span
    last = tl.minimum(first + span, length)
    best = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    total = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_R), dtype=tl.float32)
    for start in range(first, last, BLOCK_S):
        page = tl.load(table_ptr + seq * stride_tb + start // PAGE).to(tl.int64)
        row_ok = start + slots < last
        rows = kv_ptr + page * stride_kp + (start % PAGE + slots)[:, None] * stride_ks
        k_latent = tl.load(rows + rs[None, :], mask=row_ok[:, None] & (rs[None, :] < rank), other=0.0)
        k_pe = tl.load(rows + rank + ps[None, :], mask=row_ok[:, None] & (ps[None, :] < rope), other=0.0)
        if IEEE:
            scores = tl.dot(q_latent, tl.trans(k_latent), input_precision="ieee") + tl.dot(
                q_pe, tl.trans(k_pe), input_precision="ieee"
            )  # [BLOCK_H, BLOCK_S]
        else:
            scores = tl.dot(q_latent, tl.trans(k_latent)) + tl.dot(q_pe, tl.trans(k_pe))
        scores = tl.where(row_ok[None, :], scores * scale, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        correction = tl.exp(best - new_best)
        probs = tl.exp(scores - new_best[:, None])
        total = total * correction + tl.sum(probs, axis=1)
        if IEEE:
            update = tl.dot(probs, k_latent, input_precision="ieee")
        else:
            update = tl.dot(probs.to(k_latent.dtype), k_latent)
        acc = acc * correction[:, None] + update
        best = new_best
    # An empty split (its rows all past the length) leaves zeros and a log-sum-exp of -inf: it weighs nothing.
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    out_rows = out_ptr + seq * stride_ob + hs[:, None] * stride_oh + split * stride_os + rs[None, :]
    tl.store(out_rows, out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & (rs[None, :] < rank))
    if SPLITS > 1:
        lse = tl.where(total > 0, best + tl.log(total), float("-inf"))
        tl.store(lse_ptr + (seq * heads + hs) * SPLITS + split, lse, mask=head_ok)


def _check_pages(q: torch.Tensor, kv_pages: torch.Tensor) -> None:
    page = kv_pages.shape[1]
    if page & (page - 1) or page < 16:
        raise ValueError(f"the Triton MLA decode kernel needs a power-of-two page size >= 16 (got {page}).")
    if kv_pages.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("the Triton MLA decode kernel needs rows contiguous in their last axis.")


def _launch_mla_decode(q, kv_pages, block_table, seq_lens, scale, v_dim, out, lse, splits, block_h, block_s, num_warps):
    batch, heads, dim = q.shape
    page, rope = kv_pages.shape[1], dim - v_dim
    table = block_table.to(torch.int32)
    grid = (batch, triton.cdiv(heads, block_h), splits)
    pdl = pdl_launch(q)
    _mla_decode_kernel[grid](
        q,
        kv_pages,
        table,
        seq_lens.to(torch.int32),
        out,
        lse if lse is not None else out,
        heads,
        v_dim,
        rope,
        scale,
        q.stride(0),
        q.stride(1),
        kv_pages.stride(0),
        kv_pages.stride(1),
        table.stride(0),
        out.stride(0),
        out.stride(1),
        out.stride(2) if splits > 1 else 0,
        PAGE=page,
        BLOCK_S=min(block_s, page),
        BLOCK_H=block_h,
        BLOCK_R=max(16, next_power_of_2(v_dim)),
        BLOCK_P=max(16, next_power_of_2(max(rope, 1))),
        SPLITS=splits,
        IEEE=kv_pages.dtype == torch.float32,
        PDL=pdl_flag(pdl),
        num_warps=num_warps,
        **pdl,
    )


def mla_decode(
    q: torch.Tensor,
    kv_pages: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    v_dim: int,
    block_h: int = 16,
    block_s: int = 32,
    num_warps: int = 8,
) -> torch.Tensor:
    """See `reference.mla_decode`. The value is the latent part of the row: `v_dim` must be the latent rank
    (the first `v_dim` entries; the rest of the row is the rotary key). With a bf16 / fp16 cache the query is
    rounded to that dtype for the products (float32 accumulation and softmax). One program per sequence and block
    of heads walks all its rows; `mla_decode_partials` splits them."""
    _check_pages(q, kv_pages)
    out = torch.empty(q.shape[0], q.shape[1], v_dim, dtype=q.dtype, device=q.device)
    _launch_mla_decode(q, kv_pages, block_table, seq_lens, scale, v_dim, out, None, 1, block_h, block_s, num_warps)
    return out


def mla_decode_partials(
    q: torch.Tensor,
    kv_pages: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    v_dim: int,
    splits: int,
    block_h: int = 16,
    block_s: int = 32,
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`mla_decode` with each sequence's rows split into `splits` runs attended by separate programs (flash
    decoding: a short sequence's few rows no longer walk through one program): float32 `[B, H, splits, v_dim]`
    per-run softmax averages and `[B, H, splits]` their log-sum-exps (-inf for a run past the length), for
    `reference.combine_partials` (or `absorb_output(..., lse=)`). The runs are whole `block_s` blocks, decided on
    the device from `seq_lens`, so the call is CUDA-graph safe."""
    _check_pages(q, kv_pages)
    batch, heads = q.shape[:2]
    out = torch.empty(batch, heads, splits, v_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    if splits == 1:
        lse.fill_(0.0)  # one run: its average is the answer, whatever its log-sum-exp
    _launch_mla_decode(q, kv_pages, block_table, seq_lens, scale, v_dim, out, lse, splits, block_h, block_s, num_warps)
    return out, lse


@triton.jit
def _write_latent_row(
    b,
    latent_ptr,
    pe_ptr,
    weight_ptr,
    pages_ptr,
    table_ptr,
    lens_ptr,
    rank,
    rope,
    eps,
    stride_latent,
    stride_pe,
    stride_table,
    stride_page,
    stride_row,
    page_size,
    ROUND: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    PDL: tl.constexpr,
):
    """Sequence `b`'s new cache row: its latent normalised (`rms_norm` rounding) and times the norm weight, then
    k_pe, written at row `lens[b]` through the block table."""
    offs = tl.arange(0, BLOCK_R)
    ok = offs < rank
    norm_w = tl.load(weight_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    wait_for_inputs(PDL)
    position = tl.load(lens_ptr + b)
    page = tl.load(table_ptr + b * stride_table + position // page_size).to(tl.int64)
    row = pages_ptr + page * stride_page + (position % page_size) * stride_row
    x = tl.load(latent_ptr + b * stride_latent + offs, mask=ok, other=0.0)
    xf = x.to(tl.float32)
    normed = (xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / rank + eps)).to(x.dtype).to(tl.float32)
    value = normed * norm_w
    if ROUND:  # the weight's dtype is the latent's: the product is rounded to it, as torch's multiply would
        value = value.to(x.dtype)
    tl.store(row + offs, value.to(pages_ptr.dtype.element_ty), mask=ok)
    offs_p = tl.arange(0, BLOCK_P)
    pe = tl.load(pe_ptr + b * stride_pe + offs_p, mask=offs_p < rope, other=0.0)
    tl.store(row + rank + offs_p, pe.to(pages_ptr.dtype.element_ty), mask=offs_p < rope)


@triton.jit
def _write_latent_rows_kernel(
    latent_ptr,
    pe_ptr,
    weight_ptr,
    pages_ptr,
    table_ptr,
    lens_ptr,
    rank,
    rope,
    eps,
    stride_latent,
    stride_pe,
    stride_table,
    stride_page,
    stride_row,
    page_size,
    ROUND: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    PDL: tl.constexpr,
):
    _write_latent_row(
        tl.program_id(0).to(tl.int64),
        latent_ptr,
        pe_ptr,
        weight_ptr,
        pages_ptr,
        table_ptr,
        lens_ptr,
        rank,
        rope,
        eps,
        stride_latent,
        stride_pe,
        stride_table,
        stride_page,
        stride_row,
        page_size,
        ROUND,
        BLOCK_R,
        BLOCK_P,
        PDL,
    )


def _write_arguments(
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    pages: torch.Tensor,
    block_table: torch.Tensor,
    lens: torch.Tensor,
) -> tuple[tuple, dict]:
    """`_write_latent_row`'s runtime arguments and constexprs for `write_latent_rows`' arguments."""
    rank, rope = latent.shape[1], k_pe.shape[1]
    if latent.stride(1) != 1 or k_pe.stride(1) != 1 or pages.stride(2) != 1 or block_table.stride(1) != 1:
        raise ValueError("write_latent_rows needs rows, pages and the block table with unit inner stride.")
    promoted = torch.promote_types(norm_weight.dtype, latent.dtype)
    rounds = promoted == latent.dtype and latent.dtype != torch.float32
    return (
        (
            latent,
            k_pe,
            norm_weight,
            pages,
            block_table,
            lens,
            rank,
            rope,
            eps,
            latent.stride(0),
            k_pe.stride(0),
            block_table.stride(0),
            pages.stride(0),
            pages.stride(1),
            pages.shape[1],
        ),
        dict(ROUND=rounds, BLOCK_R=next_power_of_2(rank), BLOCK_P=next_power_of_2(max(rope, 1))),
    )


def write_latent_rows(
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    pages: torch.Tensor,
    block_table: torch.Tensor,
    lens: torch.Tensor,
) -> None:
    """See `reference.write_latent_rows`: norm, concatenation and the paged write in one kernel (one program per
    sequence)."""
    arguments, constants = _write_arguments(latent, k_pe, norm_weight, eps, pages, block_table, lens)
    pdl = pdl_launch(latent)
    _write_latent_rows_kernel[(latent.shape[0],)](*arguments, **constants, PDL=pdl_flag(pdl), num_warps=4, **pdl)


@triton.jit
def _absorb_query_kernel(
    q_ptr,
    w_ptr,
    out_ptr,
    heads,
    nope,
    rope,
    rank,
    stride_qb,
    stride_qn,
    stride_wn,
    stride_wd,
    latent_ptr,
    pe_ptr,
    weight_ptr,
    pages_ptr,
    table_ptr,
    lens_ptr,
    latent_rank,
    pe_width,
    eps,
    stride_latent,
    stride_pe,
    stride_table,
    stride_page,
    stride_row,
    page_size,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    PARTS: tl.constexpr,
    WRITE: tl.constexpr,
    ROUND: tl.constexpr,
    WRITE_R: tl.constexpr,
    WRITE_P: tl.constexpr,
    PDL: tl.constexpr,
):
    b, task = tl.program_id(0).to(tl.int64), tl.program_id(1)
    if task < heads * PARTS:
        head, part = (task // PARTS).to(tl.int64), task % PARTS
        q_row = q_ptr + b * stride_qb + head * stride_qn
        out_row = out_ptr + (b * heads + head) * (rank + rope)
        offs_d = tl.arange(0, BLOCK_D)
        offs_r = part * BLOCK_R + tl.arange(0, BLOCK_R)
        w = tl.load(
            w_ptr + head * stride_wn + offs_d[:, None] * stride_wd + offs_r[None, :],
            mask=(offs_d[:, None] < nope) & (offs_r[None, :] < rank),
            other=0.0,
        ).to(tl.float32)
        wait_for_inputs(PDL)
        q = tl.load(q_row + offs_d, mask=offs_d < nope, other=0.0).to(tl.float32)
        tl.store(out_row + offs_r, tl.sum(q[:, None] * w, axis=0), mask=offs_r < rank)
        if part == 0:
            offs_p = tl.arange(0, BLOCK_P)
            pe = tl.load(q_row + nope + offs_p, mask=offs_p < rope, other=0.0).to(tl.float32)
            tl.store(out_row + rank + offs_p, pe, mask=offs_p < rope)
    elif WRITE:  # one more program per sequence writes its new cache row
        _write_latent_row(
            b,
            latent_ptr,
            pe_ptr,
            weight_ptr,
            pages_ptr,
            table_ptr,
            lens_ptr,
            latent_rank,
            pe_width,
            eps,
            stride_latent,
            stride_pe,
            stride_table,
            stride_page,
            stride_row,
            page_size,
            ROUND,
            WRITE_R,
            WRITE_P,
            PDL,
        )


def absorb_query(
    q: torch.Tensor, w_kc: torch.Tensor, nope: int, block_r: int = 32, new_rows: tuple | None = None
) -> torch.Tensor:
    """See `reference.absorb_query`: one kernel (programs per sequence, head and block of `block_r` latent columns)
    instead of two casts, a batched GEMV and a concatenation. `w_kc` `[n, nope, r]` in any float dtype (products
    in float32) with unit inner stride: a view of `kv_b_proj`'s weight serves. With `new_rows` (the arguments of
    `write_latent_rows`), one more program per sequence writes its cache row: a decode step's MLA layer has no
    kernel for the write."""
    batch, heads, width = q.shape
    rank, rope = w_kc.shape[2], width - nope
    if q.stride(2) != 1 or w_kc.stride(2) != 1:
        raise ValueError("absorb_query needs q and W_kc with unit inner stride.")
    out = torch.empty(batch, heads, rank + rope, dtype=torch.float32, device=q.device)
    block_r = min(block_r, next_power_of_2(rank))
    parts = triton.cdiv(rank, block_r)
    if new_rows is not None:
        if new_rows[0].shape[0] != batch:
            raise ValueError(f"absorb_query's new rows are for {new_rows[0].shape[0]} sequences, q for {batch}.")
        write, constants = _write_arguments(*new_rows)
        constants = dict(ROUND=constants["ROUND"], WRITE_R=constants["BLOCK_R"], WRITE_P=constants["BLOCK_P"])
    else:
        write, constants = (q,) * 6 + (0, 0, 0.0) + (0,) * 6, dict(ROUND=False, WRITE_R=1, WRITE_P=1)
    pdl = pdl_launch(q)
    _absorb_query_kernel[(batch, heads * parts + (new_rows is not None))](
        q,
        w_kc,
        out,
        heads,
        nope,
        rope,
        rank,
        q.stride(0),
        q.stride(1),
        w_kc.stride(0),
        w_kc.stride(1),
        *write,
        BLOCK_D=next_power_of_2(nope),
        BLOCK_R=block_r,
        BLOCK_P=next_power_of_2(max(rope, 1)),
        PARTS=parts,
        WRITE=new_rows is not None,
        **constants,
        PDL=pdl_flag(pdl),
        num_warps=4,
        **pdl,
    )
    return out


@triton.jit
def _absorb_output_kernel(
    latent_ptr,
    lse_ptr,
    w_ptr,
    gate_ptr,
    out_ptr,
    heads,
    rank,
    v_dim,
    stride_wn,
    stride_wv,
    stride_gate,
    SPLITS: tl.constexpr,
    HAS_GATE: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PDL: tl.constexpr,
):
    b, head, part = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64), tl.program_id(2)
    offs_v = part * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_r = tl.arange(0, BLOCK_R)
    w = tl.load(
        w_ptr + head * stride_wn + offs_v[:, None] * stride_wv + offs_r[None, :],
        mask=(offs_v[:, None] < v_dim) & (offs_r[None, :] < rank),
        other=0.0,
    ).to(tl.float32)
    wait_for_inputs(PDL)
    if HAS_GATE:  # loaded with the latents: issued at the end it costs the program one more round trip
        g = tl.load(gate_ptr + b * stride_gate + head * v_dim + offs_v, mask=offs_v < v_dim, other=0.0)
    row = (b * heads + head) * SPLITS
    if SPLITS > 1:  # combine the runs' softmax averages, weighted by their share of the softmax mass
        offs_s = tl.arange(0, SPLITS)
        lse = tl.load(lse_ptr + row + offs_s)
        weight = tl.exp(lse - tl.max(lse, axis=0))
        parts = tl.load(
            latent_ptr + (row + offs_s[:, None]) * rank + offs_r[None, :], mask=offs_r[None, :] < rank, other=0.0
        )
        latent = tl.sum(weight[:, None] * parts, axis=0) / tl.sum(weight, axis=0)
    else:
        latent = tl.load(latent_ptr + row * rank + offs_r, mask=offs_r < rank, other=0.0)
    out = tl.sum(w * latent[None, :], axis=1).to(out_ptr.dtype.element_ty)
    if HAS_GATE:  # each op rounded to the output dtype, as the separate sigmoid and multiply would be
        gate = tl.sigmoid(g.to(tl.float32)).to(out_ptr.dtype.element_ty)
        out = (out.to(tl.float32) * gate.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + (b * heads + head) * v_dim + offs_v, out, mask=offs_v < v_dim)


def absorb_output(
    latent: torch.Tensor,
    w_vc: torch.Tensor,
    dtype: torch.dtype,
    gate: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    block_v: int | None = None,
) -> torch.Tensor:
    """See `reference.absorb_output`: one kernel instead of a batched GEMV, a cast and, with the gate, a sigmoid
    and a multiply. With `lse` `[B, n, S]`, `latent` is `mla_decode_partials`' `[B, n, S, r]` and is combined
    first (`reference.combine_partials`). `w_vc` `[n, v, r]` in any float dtype with unit inner stride."""
    batch, heads = latent.shape[:2]
    rank, v_dim = latent.shape[-1], w_vc.shape[1]
    splits = 1 if lse is None else lse.shape[2]
    if splits & (splits - 1):
        raise ValueError(f"absorb_output combines a power-of-two number of runs (got {splits}).")
    if (
        not latent.is_contiguous()
        or w_vc.stride(2) != 1
        or (gate is not None and gate.stride(-1) != 1)
        or (lse is not None and not lse.is_contiguous())
    ):
        raise ValueError(
            "absorb_output needs contiguous latents (and lse), and W_vc and a gate with unit inner stride."
        )
    out = torch.empty(batch, heads, v_dim, dtype=dtype, device=latent.device)
    # Narrow blocks give a batch of one enough programs; wider ones re-read the latents less at larger batches.
    block_v = min(block_v or (8 if batch <= 4 else 32), next_power_of_2(v_dim))
    gate_rows = gate.reshape(batch, heads * v_dim) if gate is not None else latent
    pdl = pdl_launch(latent)
    _absorb_output_kernel[(batch, heads, triton.cdiv(v_dim, block_v))](
        latent,
        lse if lse is not None else latent,
        w_vc,
        gate_rows,
        out,
        heads,
        rank,
        v_dim,
        w_vc.stride(0),
        w_vc.stride(1),
        gate_rows.stride(0),
        SPLITS=splits,
        HAS_GATE=gate is not None,
        BLOCK_V=block_v,
        BLOCK_R=next_power_of_2(rank),
        PDL=pdl_flag(pdl),
        num_warps=4,
        **pdl,
    )
    return out
