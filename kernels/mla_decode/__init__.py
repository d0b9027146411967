"""Paged MLA decode attention: `mla_decode(q, kv_pages, block_table, seq_lens, scale, v_dim)`.

On CUDA the Triton kernel (graph safe, reads only live pages) runs when the page size suits it (a power of two
>= 16); elsewhere the torch reference, which loops over the sequences on the host. `mla_decode_partials` splits
each sequence's rows over several programs (combined by `absorb_output`). `mla_decode_masked` is the torch form
without host synchronisation (reads every page of the table)."""

import torch

from h3gen.kernels._dispatch import use_triton
from h3gen.kernels.mla_decode import reference
from h3gen.kernels.mla_decode.reference import mla_decode_masked


def mla_decode(q, kv_pages, block_table, seq_lens, scale, v_dim):
    """`q` `[B, H, D]`, `kv_pages` `[P, page_size, D]`, `block_table` `[B, max_pages]`, `seq_lens` `[B]` ->
    `[B, H, v_dim]` (see `reference.mla_decode`)."""
    page = kv_pages.shape[1]
    if use_triton(q) and page >= 16 and not page & (page - 1):
        from h3gen.kernels.mla_decode import triton as fast  # on first use: see _dispatch

        return fast.mla_decode(q, kv_pages, block_table, seq_lens, scale, v_dim)
    return reference.mla_decode(q, kv_pages, block_table, seq_lens, scale, v_dim)


def mla_decode_partials(q, kv_pages, block_table, seq_lens, scale, v_dim, splits):
    """`mla_decode` split into `splits` runs per sequence: float32 `[B, H, splits, v_dim]` run averages and
    `[B, H, splits]` log-sum-exps, for `absorb_output(..., lse=)` (see `reference.mla_decode_partials`)."""
    page = kv_pages.shape[1]
    if use_triton(q) and page >= 16 and not page & (page - 1):
        from h3gen.kernels.mla_decode import triton as fast  # on first use: see _dispatch

        return fast.mla_decode_partials(q, kv_pages, block_table, seq_lens, scale, v_dim, splits)
    return reference.mla_decode_partials(q, kv_pages, block_table, seq_lens, scale, v_dim, splits)


def mla_decode_splits(batch: int, device) -> int:
    """How many runs `mla_decode_partials` should split each sequence's rows into for a decode batch of `batch`:
    a power of two, enough programs to occupy a GPU at small batches (8 up to 8 sequences, halving as the batch
    doubles), and 1 (the plain `mla_decode`) off CUDA or from 64 sequences on. (H200, mid config, whole b=1 step:
    8 splits 0.753-0.757 ms against 0.762 for 16 and 0.759 for 4.)"""
    if torch.device(device).type != "cuda":
        return 1
    splits = 8
    while splits > 1 and splits * batch > 64:
        splits //= 2
    return splits


def write_latent_rows(latent, k_pe, norm_weight, eps, pages, block_table, lens):
    """Normalise `latent` `[B, r]`, append `k_pe` `[B, d_r]` and write the rows at positions `lens` `[B]` of the
    paged MLA cache `pages` through `block_table` (see `reference.write_latent_rows`; one Triton kernel on CUDA)."""
    if use_triton(latent):
        from h3gen.kernels.mla_decode import triton as fast  # on first use: see _dispatch

        return fast.write_latent_rows(latent, k_pe, norm_weight, eps, pages, block_table, lens)
    return reference.write_latent_rows(latent, k_pe, norm_weight, eps, pages, block_table, lens)


def absorb_query(q, w_kc, nope, new_rows=None):
    """`q` `[B, n, nope + d_r]` -> the absorbed query `[B, n, r + d_r]` float32 (see `reference.absorb_query`);
    with `new_rows` (`write_latent_rows`' arguments) the step's cache rows are written by the same launch."""
    if use_triton(q):
        from h3gen.kernels.mla_decode import triton as fast  # on first use: see _dispatch

        return fast.absorb_query(q, w_kc, nope, new_rows=new_rows)
    return reference.absorb_query(q, w_kc, nope, new_rows)


def absorb_output(latent, w_vc, dtype, gate=None, lse=None):
    """Attended latents `[B, n, r]` float32 -> `[B, n, v]` in `dtype`, times sigmoid(`gate`) when given; with `lse`,
    the latents are `mla_decode_partials`' runs, combined first (see `reference.absorb_output`)."""
    if use_triton(latent):
        from h3gen.kernels.mla_decode import triton as fast  # on first use: see _dispatch

        return fast.absorb_output(latent, w_vc, dtype, gate, lse)
    return reference.absorb_output(latent, w_vc, dtype, gate, lse)


__all__ = [
    "absorb_output",
    "absorb_query",
    "mla_decode",
    "mla_decode_masked",
    "mla_decode_partials",
    "mla_decode_splits",
    "write_latent_rows",
]
