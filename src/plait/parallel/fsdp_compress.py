"""parallel.compression = topk | int8 | powersgd under ZeRO-2/3 (inside pipeline stages and with cp too): what FSDP2
reduce-scatters is compressed.

FSDP2 lays each unit's gradients into one flat buffer before its reduce-scatter: for every rank r in turn, every
parameter's r-th chunk of rows (dim 0 padded to a multiple of the ranks). A custom reduce-scatter (FSDP2's
`set_custom_reduce_scatter`) receives that buffer and fills this rank's chunk:

* topk / int8 run plait's own schemes on the whole buffer (each rank's top-k (value, index) pairs all-gathered; the
  int8 all-to-all and all-gather) and keep this rank's chunk of the mean, with the error feedback of DDP's buckets;
* powersgd sees each parameter's gradient as the matrix it is: the buffer is regathered parameter by parameter
  (rank r's rows of a parameter are rows r*c .. (r+1)*c of its padded gradient), torch's PowerSGD hook averages the
  matrices (P and Q all-reduced; vectors and small matrices plainly), and this rank keeps its rows.

The bytes on the wire are the scheme's (an all-gather of 2k values, or P and Q) instead of the reduce-scatter's
(n - 1)/n of the buffer; the uncompressed volume is tallied as that reduce-scatter's for the logged ratio.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state

from plait.comm.compression import Compression, CompressionState, compressed_average


class CompressedReduceScatter(ReduceScatter):
    """One FSDP2 unit's reduce-scatter by the configured compression (see the module's docstring)."""

    def __init__(self, state: CompressionState, unit: nn.Module, key: int):
        self.state, self.unit, self.key = state, unit, key

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False) -> None:
        n = dist.get_world_size(group)
        if n != self.state.world:
            raise RuntimeError(f"compressed reduce-scatter over {n} ranks, its state over {self.state.world}")
        if op not in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
            raise RuntimeError(f"compressed reduce-scatter: FSDP2 asked for {op}; top-k, int8 and PowerSGD average "
                               "float32 gradients (AVG or SUM)")
        views = None
        if self.state.spec.kind == "powersgd":
            flat, views = self._by_parameter(input_tensor, n)
        else:
            flat = input_tensor
        # FSDP2 runs the units in no fixed order, once per micro-batch in pipeline stages: the strategy ends the step
        mean = compressed_average(self.state, flat, (self.key,), reduce_scatter=True, views=views, last=False)
        if views is not None:
            mean = _by_rank(views, n)
        c = output_tensor.numel()
        mine = mean[dist.get_rank(group) * c:(dist.get_rank(group) + 1) * c]
        output_tensor.copy_(mine * n if op == dist.ReduceOp.SUM else mine)
        return None

    def _by_parameter(self, flat: torch.Tensor, n: int):
        """The buffer laid out parameter by parameter: (that buffer, each padded gradient as a view of it)."""
        state = _get_module_fsdp_state(self.unit)
        group = state._fsdp_param_group
        shapes = [tuple(fp.padded_sharded_param_size) for fp in group.fsdp_params
                  if hasattr(fp, "_unsharded_param") and fp._unsharded_param.requires_grad]
        sizes = [torch.Size(s).numel() for s in shapes]
        if n * sum(sizes) != flat.numel():
            raise RuntimeError(f"compressed reduce-scatter: {flat.numel()} gradient entries, and the unit's "
                               f"{len(shapes)} parameters that train hold {n * sum(sizes)}")
        rows = flat.view(n, -1)
        out, views, at = torch.empty_like(flat), [], 0
        for shape, size in zip(shapes, sizes):
            whole = out[n * at:n * (at + size)]
            whole.view(n, size).copy_(rows[:, at:at + size])  # rank r's rows follow rank r - 1's
            views.append(whole.view(n * shape[0], *shape[1:]))
            at += size
        return out, views


def _by_rank(views: list[torch.Tensor], n: int) -> torch.Tensor:
    """The parameter-by-parameter buffer back in FSDP2's layout: every parameter's rank-0 rows, then rank 1's, ..."""
    chunks = [v.reshape(n, -1) for v in views]
    return torch.cat(chunks, dim=1).reshape(-1)


def install(model: nn.Module, group, spec: Compression) -> CompressionState:
    """Give every FSDP2 unit of model a compressed reduce-scatter sharing one state, kept as `model.plait_compression`
    (the strategy calls its end_step() once the step's gradients are reduced); returns it."""
    state = CompressionState(group, spec)
    units = [m for m in model.modules() if hasattr(m, "set_custom_reduce_scatter")]
    for i, unit in enumerate(units):
        unit.set_custom_reduce_scatter(CompressedReduceScatter(state, unit, i))
    setattr(model, "plait_compression", state)  # noqa: B010 (an nn.Module attribute that is no tensor or module)
    return state
