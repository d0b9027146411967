"""Paged MLA decode attention in plain torch (the absorbed form: one shared latent KV head).

Every cached token of a sequence is one row `[c_kv (r) | k_pe (d_r)]` stored in fixed-size pages; `block_table`
lists each sequence's pages in order. A decode query per head is `[q_nope · W_kc (r) | q_pe (d_r)]`, and the value
is the first `v_dim` (= r) entries of the same row.
"""

import torch

from h3gen.kernels.rmsnorm.reference import rms_norm


def mla_decode(
    q: torch.Tensor, kv_pages: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, v_dim: int
) -> torch.Tensor:
    """`q` `[B, H, D]`, `kv_pages` `[P, page_size, D]`, `block_table` `[B, max_pages]` (int), `seq_lens` `[B]` ->
    `[B, H, v_dim]` in q.dtype: `softmax(scale · q kv^T) kv[:, :v_dim]` over each sequence's first seq_lens rows,
    float32 math."""
    page_size = kv_pages.shape[1]
    out = q.new_empty(q.shape[0], q.shape[1], v_dim)
    for b in range(q.shape[0]):
        length = int(seq_lens[b])
        pages = block_table[b, : -(-length // page_size)].long()
        rows = kv_pages[pages].reshape(-1, kv_pages.shape[-1])[:length].float()
        probs = torch.softmax(scale * q[b].float() @ rows.t(), dim=-1)
        out[b] = (probs @ rows[:, :v_dim]).to(q.dtype)
    return out


def mla_decode_masked(
    q: torch.Tensor, kv_pages: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, v_dim: int
) -> torch.Tensor:
    """`mla_decode` without host synchronisation (CUDA-graph safe): every sequence reads all `max_pages` pages of
    its table row and masks the rows past its length. Same arguments and result."""
    batch, heads, dim = q.shape
    rows = kv_pages[block_table.long()].reshape(batch, -1, dim).float()  # [B, max_pages * page_size, D]
    scores = scale * torch.einsum("bhd,bsd->bhs", q.float(), rows)
    valid = torch.arange(rows.shape[1], device=q.device)[None, :] < seq_lens[:, None]
    probs = torch.softmax(scores.masked_fill(~valid[:, None, :], float("-inf")), dim=-1)
    return torch.einsum("bhs,bsv->bhv", probs, rows[..., :v_dim]).to(q.dtype)


def write_latent_rows(
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    pages: torch.Tensor,
    block_table: torch.Tensor,
    lens: torch.Tensor,
) -> None:
    """One decode step's MLA cache rows: `latent` `[B, r]` RMS-normalised (`rms_norm` rounding), then `k_pe`
    `[B, d_r]`, written as row `lens[b]` of sequence b into `pages` `[P, page_size, r + d_r]` through
    `block_table` `[B, W]` (int32 page ids; `lens` `[B]` int32)."""
    row = torch.cat([rms_norm(latent, norm_weight, eps), k_pe], dim=-1)
    page_size = pages.shape[1]
    position = lens.long()
    page = block_table.long().gather(1, (position // page_size)[:, None])[:, 0]
    pages[page, position % page_size] = row.to(pages.dtype)


def mla_decode_partials(
    q: torch.Tensor,
    kv_pages: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    v_dim: int,
    splits: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`mla_decode` over `splits` consecutive runs of each sequence's rows (here of `ceil(len / splits)` rows; the
    kernel rounds runs to its row block): float32 `[B, H, splits, v_dim]` softmax averages per run and
    `[B, H, splits]` their log-sum-exps (-inf, with zeros, for an empty run). `combine_partials` gives
    `mla_decode`'s answer (in float32)."""
    page_size = kv_pages.shape[1]
    batch, heads = q.shape[:2]
    out = q.new_zeros(batch, heads, splits, v_dim, dtype=torch.float32)
    lse = q.new_full((batch, heads, splits), float("-inf"), dtype=torch.float32)
    for b in range(batch):
        length = int(seq_lens[b])
        pages = block_table[b, : -(-length // page_size)].long()
        rows = kv_pages[pages].reshape(-1, kv_pages.shape[-1])[:length].float()
        span = -(-length // splits)
        for s in range(splits):
            run = rows[s * span : (s + 1) * span]
            if len(run):
                scores = scale * q[b].float() @ run.t()
                out[b, :, s] = torch.softmax(scores, dim=-1) @ run[:, :v_dim]
                lse[b, :, s] = torch.logsumexp(scores, dim=-1)
    return out, lse


def combine_partials(partials: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """`[B, H, S, v]` per-run averages and `[B, H, S]` log-sum-exps -> `[B, H, v]` float32: the average over all
    runs (each weighted by its share of the softmax mass)."""
    weight = torch.softmax(lse, dim=-1)
    return (weight[..., None] * partials).sum(dim=2)


def absorb_query(q: torch.Tensor, w_kc: torch.Tensor, nope: int, new_rows: tuple | None = None) -> torch.Tensor:
    """The absorbed decode query: `q` `[B, n, nope + d_r]` -> `[B, n, r + d_r]` float32, `[q_nope · W_kc | q_pe]`
    with `w_kc` `[n, nope, r]` (any float dtype; products in float32). `new_rows`: optional arguments of
    `write_latent_rows` (the step's cache rows), written by the same op."""
    if new_rows is not None:
        write_latent_rows(*new_rows)
    q_nope, q_pe = q.split([nope, q.shape[-1] - nope], dim=-1)
    return torch.cat([torch.einsum("bnd,ndr->bnr", q_nope.float(), w_kc.float()), q_pe.float()], dim=-1)


def absorb_output(
    latent: torch.Tensor,
    w_vc: torch.Tensor,
    dtype: torch.dtype,
    gate: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """The decode output from the attended latents: `latent` `[B, n, r]` float32 times `w_vc` `[n, v, r]` (any
    float dtype, products in float32) -> `[B, n, v]` in `dtype`; with `gate` `[B, n * v]` (in `dtype`), times its
    sigmoid, each op rounded to `dtype` as torch's separate ops would be. With `lse`, `latent` holds
    `mla_decode_partials`' runs `[B, n, S, r]`, combined first."""
    if lse is not None:
        latent = combine_partials(latent, lse)
    out = torch.einsum("bnr,nvr->bnv", latent, w_vc.float()).to(dtype)
    if gate is not None:
        out = out * torch.sigmoid(gate).view_as(out)
    return out
