"""Paged MLA decode attention: `mla_decode(q, kv_pages, block_table, seq_lens, scale, v_dim)`.

Only the torch reference exists so far; it runs on every device."""

from h3gen.kernels.mla_decode.reference import mla_decode

__all__ = ["mla_decode"]
