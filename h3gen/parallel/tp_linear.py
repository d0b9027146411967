"""Megatron-style tensor-parallel linears, built from a model's `LinearSpec`s by the factory in `h3gen.linear`.

Parameters keep the names `weight` and `bias` (state-dict keys never change); they hold this rank's shard.
`load_shard(name, full)` cuts a full checkpoint tensor down to the shard, so loading needs no knowledge of the
layout beyond asking the module. `quantize_fp8()` turns the shard to e4m3 for the `fast` tier: the local product
becomes an FP8 GEMM (`h3gen.quant.fp8.fp8_matmul`), the collectives stay as they are. With `quantization="mxfp4"`
the block linears are `ColumnParallelMXFP4Linear` / `RowParallelMXFP4Linear`: the same shards held as MXFP4
(`weight_packed` / `weight_scale`, quantized from the shard as it loads or cut from a checkpoint's packed bytes).
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from h3gen.kernels.mxfp4_gemm import mxfp4_matmul
from h3gen.linear_spec import LinearSpec
from h3gen.parallel.state import ParallelState
from h3gen.quant.fp8 import fp8_matmul, fp8_weight
from h3gen.quant.mxfp4_format import BLOCK, padded_width, quantize


def _shape(full) -> list[int]:
    """Shape of a tensor or of a lazy safetensors slice (`get_slice`), which reads only what is indexed."""
    return list(full.shape) if isinstance(full, torch.Tensor) else list(full.get_shape())


class _ShardLinear(nn.Module):
    """The local product of a TP linear: bf16 `F.linear` over the shard, or FP8 after `quantize_fp8()`.

    `partial_hook`, when set, is called as `partial_hook(x, y_local)` on this rank's partial product before any
    collective and returns the tensor to use instead (`h3gen.lora` adds its shard of an adapter's update there)."""

    fp8 = False
    partial_hook = None

    def quantize_fp8(self) -> None:
        """Hold this rank's shard as e4m3 with a float32 scale per output feature (the `fast` tier); the local
        product then takes bf16 rows (quantized per row) or e4m3 `Fp8Rows` from a fused kernel."""
        if self.fp8:
            return
        self.compute_dtype = self.weight.dtype
        values, scale = fp8_weight(self.weight)
        del self.weight
        self.register_buffer("weight", values)
        self.register_buffer("weight_scale", scale)
        self.fp8 = True

    def _local(self, x, bias):
        if self.fp8:
            return fp8_matmul(x, self.weight, self.weight_scale, bias, self.compute_dtype)
        return F.linear(x, self.weight, bias)


def _rank_range(size: int, parts: int, index: int) -> tuple[int, int]:
    if size % parts:
        raise ValueError(f"cannot split {size} features over {parts} tensor-parallel ranks.")
    step = size // parts
    return index * step, (index + 1) * step


class ColumnParallelLinear(_ShardLinear):
    """Output features sharded: `y_local = x @ W_local^T (+ b_local)`; with `gather_output`, the shards are
    all-gathered along the last axis so every rank gets the whole `y`."""

    def __init__(self, spec: LinearSpec, state: ParallelState):
        super().__init__()
        self.state, self.splits, self.gather_output = state, spec.splits or (spec.out_features,), spec.gather_output
        if sum(self.splits) != spec.out_features:
            raise ValueError(f"splits {self.splits} do not add up to {spec.out_features} output features.")
        local = sum(part // state.tp for part in self.splits)
        self.in_features, self.out_features = spec.in_features, spec.out_features
        self.weight = nn.Parameter(torch.empty(local, spec.in_features))
        self.bias = nn.Parameter(torch.empty(local)) if spec.bias else None

    def load_shard(self, name: str, full) -> torch.Tensor:
        """This rank's rows of a full `weight` / `bias` (a tensor or a lazy safetensors slice, of which only these
        rows are read): its chunk of every logical part, in order."""
        if _shape(full)[0] != sum(self.splits):
            return full[:]  # a mis-shaped tensor: let the loader report it
        pieces, offset = [], 0
        for part in self.splits:
            start, stop = _rank_range(part, self.state.tp, self.state.tp_rank)
            pieces.append(full[offset + start : offset + stop])
            offset += part
        return torch.cat(pieces, dim=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._local(x, self.bias)
        if self.partial_hook is not None:
            y = self.partial_hook(x, y)
        if self.gather_output and self.state.tp > 1:
            shards = [torch.empty_like(y) for _ in range(self.state.tp)]
            dist.all_gather(shards, y.contiguous(), group=self.state.tp_group)
            y = torch.cat(shards, dim=-1)
        return y


class RowParallelLinear(_ShardLinear):
    """Input features sharded (the output of a column-parallel layer): partial products all-reduced, bias added
    once."""

    def __init__(self, spec: LinearSpec, state: ParallelState):
        super().__init__()
        if spec.in_features % state.tp:
            raise ValueError(f"cannot split {spec.in_features} input features over {state.tp} ranks.")
        self.state = state
        self.in_features, self.out_features = spec.in_features, spec.out_features
        self.weight = nn.Parameter(torch.empty(spec.out_features, spec.in_features // state.tp))
        self.bias = nn.Parameter(torch.empty(spec.out_features)) if spec.bias else None

    def load_shard(self, name: str, full) -> torch.Tensor:
        """This rank's input columns of `weight` (read lazily from a slice); `bias` whole."""
        shape = _shape(full)
        if name != "weight" or len(shape) != 2 or shape[1] != self.in_features:
            return full[:]
        start, stop = _rank_range(shape[1], self.state.tp, self.state.tp_rank)
        return full[:, start:stop]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._local(x, None)  # the bias is added once, after the sum over ranks
        if self.partial_hook is not None:
            y = self.partial_hook(x, y)
        if self.state.tp > 1:
            dist.all_reduce(y, group=self.state.tp_group)
        return y + self.bias if self.bias is not None else y


class _MXFP4Shard:
    """This rank's shard held as MXFP4: `weight_packed` `[rows, Kp / 2]` and `weight_scale` `[rows, Kp / 32]` uint8
    (Kp = the shard's input width padded to 32), the local product `kernels.mxfp4_gemm.mxfp4_matmul`."""

    takes_lazy_slices = True  # `load_checkpoint_tensor` cuts a safetensors slice before reading it

    def _hold_mxfp4(self, rows: int, local_in: int, compute_dtype: torch.dtype) -> None:
        del self.weight
        width = padded_width(local_in)
        self.register_buffer("weight_packed", torch.zeros(rows, width // 2, dtype=torch.uint8))
        self.register_buffer("weight_scale", torch.zeros(rows, width // BLOCK, dtype=torch.uint8))
        self.local_in, self.compute_dtype = local_in, compute_dtype

    def load_checkpoint_tensor(self, name: str, tensor, device, dtype) -> bool:
        """A full-precision `weight` (tensor or lazy slice): cut to this rank's shard, quantized here. Packed
        checkpoint tensors go through `load_shard` (returns False)."""
        if name != "weight":
            return False
        shard = self.load_shard("weight", tensor)
        shard = shard if isinstance(shard, torch.Tensor) else shard[:]
        self.weight_packed, self.weight_scale = quantize(shard.to(device))
        self.compute_dtype = dtype
        return True

    def quantize_fp8(self) -> None:
        """MXFP4 shards stay MXFP4 in the `fast` tier (re-quantizing them to FP8 would double their bytes)."""

    def _local(self, x, bias):
        rows = x.reshape(-1, self.local_in).to(self.compute_dtype)
        out = mxfp4_matmul(rows, self.weight_packed, self.weight_scale)
        if bias is not None:
            out = out + bias.to(out.dtype)
        return out.reshape(*x.shape[:-1], out.shape[-1])


class ColumnParallelMXFP4Linear(_MXFP4Shard, ColumnParallelLinear):
    """`ColumnParallelLinear` whose shard (its rows of every part) is MXFP4."""

    def __init__(self, spec: LinearSpec, state: ParallelState, compute_dtype: torch.dtype = torch.bfloat16):
        super().__init__(spec, state)
        self._hold_mxfp4(self.weight.shape[0], spec.in_features, compute_dtype)


class RowParallelMXFP4Linear(_MXFP4Shard, RowParallelLinear):
    """`RowParallelLinear` whose shard is MXFP4: the 32-element blocks covering this rank's input columns. Where a
    cut falls inside a block, both ranks hold that block and multiply its other columns by zeros, so the sum over
    ranks equals the whole layer exactly."""

    def __init__(self, spec: LinearSpec, state: ParallelState, compute_dtype: torch.dtype = torch.bfloat16):
        super().__init__(spec, state)
        start, stop = _rank_range(spec.in_features, state.tp, state.tp_rank)
        self.first_block, self.end_block = start // BLOCK, -(-stop // BLOCK)
        self.offset, self.columns = start - self.first_block * BLOCK, stop - start  # x's place in the blocks
        self._hold_mxfp4(spec.out_features, (self.end_block - self.first_block) * BLOCK, compute_dtype)

    def load_shard(self, name: str, full):
        """This rank's covering blocks: columns of a full `weight`, of packed bytes or of scales; `bias` whole."""
        shape = _shape(full)
        per_column = {"weight": 1, "weight_packed": 2, "weight_scale": BLOCK}.get(name)
        width = self.in_features if name == "weight" else padded_width(self.in_features)
        if per_column is None or len(shape) != 2 or shape[1] * per_column != width:
            return full[:]  # the bias, or a mis-shaped tensor for the loader to report
        stop = min(self.end_block * BLOCK, width)
        return full[:, self.first_block * BLOCK // per_column : -(-stop // per_column)]

    def _local(self, x, bias):
        if self.offset or self.columns != self.local_in:  # place x's columns within the covering blocks
            padded = x.new_zeros(*x.shape[:-1], self.local_in)
            padded[..., self.offset : self.offset + self.columns] = x
            x = padded
        return super()._local(x, bias)
