"""Mixture-of-Experts feed-forward: routing, the expert computation, and the sparse MoE block.

Routing (`route`): softmax over the router logits in float32, top-k, and (Mixtral always; Qwen2-MoE,
Qwen3-MoE and OLMoE when `norm_topk_prob`) the top-k weights renormalized to sum to 1.

Expert computation, two implementations of one contract
`(x [T, H], w13 [E, 2I, H], w2 [E, H, I], weights [T, k], ids [T, k]) -> [T, H]`:
- `moe_reference`: every expert on every token, combined with a dense [T, E] weight matrix that is
  zero for experts a token did not pick. Obviously correct and the spec; O(E) work per token.
- `moe_grouped`: the (token, expert) assignments sorted by expert (one argsort), the tokens gathered
  into one contiguous buffer so each active expert runs once on its rows (two matmuls), the results
  weighted and summed per token with one batched matmul. No per-token loops, no capacity limit, no
  token dropping; the only Python loop is over the experts that received tokens.
- `moe_grouped_mm`: the same with the loop replaced by two `F.grouped_mm` calls whose group offsets
  stay on the device (no host synchronization: CUDA-graph safe); used for bf16 on CUDA. It runs on
  the CPU too, where the tests hold it to the reference.
- `moe_triton`: the same with kernels/triton_moe.py's grouped GEMM (every dtype; offsets from a
  device-side search, no host synchronization); used on CUDA where grouped_mm does not apply.
  Tested on the CPU under Triton's interpreter (tests/runtime/test_moe_triton.py).
`moe_backend_name` is the one place that chooses among them (as kernels/attention.select_backend
does for attention). On the CPU the `grouped` backend's 16/32-bit experts run as one C call,
kernels/cpu_moe.fused_experts (`FusedMoE.forward`; each active expert's weights read once for all its
rows, silu * mul and the weighted combine in the kernel, AVX512-BF16 dot products for bfloat16),
for bfloat16 experts on CPUs with AVX512-BF16 at every batch size (prefill too: as fast as torch's
GEMMs in CPU time, and with several threads two dynamically scheduled parallel loops instead of a
barrier after each of the loop's 2 x (active experts) matmuls), for float32 (and bfloat16 widened to
float32) where the batch gives at most cpu_moe.MAX_ROWS_PER_EXPERT rows per held expert on average
(decode); more rows keep the per-expert torch matmuls there (`cpu_moe.max_rows_per_expert`).

Quantized experts (`--quantization int8|int4`, `FusedMoE.quantize`): each expert's w13 and w2 become
a kernels/qlinear.QuantizedWeight (int8 per output channel, or int4 with a scale and min per group
of K), so the stacked [E, N, K] tensors turn into one QuantizedWeight per expert. `moe_grouped` takes
either form; with quantized experts each active expert's two matmuls are `qlinear.matmul` on its
rows: the C kernel reading the quantized bytes for up to qlinear.SMALL_M rows (a decode step's few
rows per expert), dequantize + torch matmul above that (prefill); on CUDA, the Triton kernel
kernels/triton_qlinear.py for every row count.

Parallelism (`FusedMoE`): under tensor parallelism each expert's intermediate width I is split across
ranks like the dense MLP (w13 by rows, w2 by columns) and the per-rank partial sums are all-reduced;
with expert parallelism each rank holds E / N whole experts and computes only the assignments that
fall on them, and the same all-reduce adds the ranks' contributions. Either way every rank routes
every token with the replicated router, so no token moves between ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.kernels import cpu_moe, qlinear
from kvpilot.kernels.qlinear import QuantizedWeight
from kvpilot.runtime.models.layers import (
    HoldsQuantized,
    MergedColumnParallelLinear,
    RowParallelLinear,
    SiluAndMul,
)
from kvpilot.runtime.models.parallel import (
    divide,
    expert_parallel_enabled,
    get_tp_rank,
    get_tp_world_size,
    tp_all_reduce,
)

# Checkpoint piece of one expert -> (fused parameter, row block within it): gate and up share w13.
EXPERT_PIECES = ("w1", "w3", "w2")  # gate, up, down (Mixtral's names; Qwen/OLMoE map onto them)


# One layer's experts: stacked [E, N, K] (each expert's nn.Linear weight), or one QuantizedWeight each
ExpertWeights = torch.Tensor | Sequence[QuantizedWeight]


def _expert_mm(x: torch.Tensor, w: ExpertWeights, e: int) -> torch.Tensor:
    """x [R, K] @ expert e's weight^T -> [R, N]."""
    if isinstance(w, torch.Tensor):
        return torch.mm(x, w[e].t())
    return qlinear.matmul(x, w[e])


def dequantize_experts(w: Sequence[QuantizedWeight], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The stacked [E, N, K] tensor equal to quantized experts (the reference they are tested against)."""
    return torch.stack([q.dequantize(dtype) for q in w])


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k] int64): softmax (float32) -> top-k -> renormalize."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2)


def moe_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    expert_offset: int = 0,
) -> torch.Tensor:
    """The spec: sum over the experts held here (global ids expert_offset .. +E) of
    weight(token, expert) * expert(token), computing every held expert on every token."""
    num_local = w13.shape[0]
    dense = torch.zeros(x.shape[0], num_local, dtype=torch.float32, device=x.device)
    local = ids - expert_offset
    held = (local >= 0) & (local < num_local)
    dense.scatter_add_(1, local.clamp(0, num_local - 1), torch.where(held, weights.float(), 0.0))
    out = torch.zeros_like(x)
    for e in range(num_local):
        out += dense[:, e : e + 1].to(x.dtype) * _expert(x, w13[e], w2[e])
    return out


def moe_grouped(
    x: torch.Tensor,
    w13: ExpertWeights,
    w2: ExpertWeights,
    weights: torch.Tensor,
    ids: torch.Tensor,
    expert_offset: int = 0,
) -> torch.Tensor:
    """`moe_reference`'s result with each held expert run once, on exactly the tokens routed to it
    (stacked or quantized experts)."""
    t, k = ids.shape
    num_local = len(w13)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # assignment rows grouped by expert, token order kept
    counts = torch.bincount(flat, minlength=expert_offset + num_local)
    starts = torch.cumsum(counts, 0) - counts
    counts_l = counts[expert_offset : expert_offset + num_local].tolist()
    # the assignments of the experts held here are one contiguous run of the sorted order (all of
    # it without expert parallelism); the others' rows stay zero
    lo = int(starts[expert_offset])
    mine = order[lo : lo + sum(counts_l)]
    xs = x.index_select(0, mine // k)  # each assignment's token, in expert order
    partial = x.new_empty(mine.numel(), x.shape[1])
    start = 0
    for e, n in enumerate(counts_l):
        if n == 0:
            continue
        rows = slice(start, start + n)
        start += n
        gate_up = _expert_mm(xs[rows], w13, e)
        act = F.silu(gate_up[:, : gate_up.shape[1] // 2]) * gate_up[:, gate_up.shape[1] // 2 :]
        if isinstance(w2, torch.Tensor):
            torch.mm(act, w2[e].t(), out=partial[rows])
        else:
            partial[rows] = qlinear.matmul(act, w2[e])
    held_all = mine.numel() == t * k
    unsorted = x.new_empty(t * k, x.shape[1]) if held_all else x.new_zeros(t * k, x.shape[1])
    unsorted[mine] = partial  # back to (token, k) order
    return torch.bmm(weights.to(x.dtype).unsqueeze(1), unsorted.view(t, k, x.shape[1])).squeeze(1)


def _grouped_on_device(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    expert_offset: int,
    num_local: int,
    gemm13: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    gemm2: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The device-side grouped MoE both GPU backends share: assignments sorted by local expert (those
    held elsewhere, under expert parallelism, one group past the last), group offsets [E + 1] from a
    search over the sorted ids (on the device: no host synchronization, so it can be captured in a
    CUDA graph), the two grouped GEMMs (`gemm(rows, offsets)`), rows past the last group zeroed, and
    the routing-weighted combine."""
    t, k = ids.shape
    local = ids.reshape(-1) - expert_offset
    held = (local >= 0) & (local < num_local)
    local = torch.where(held, local, num_local)
    order = torch.argsort(local, stable=True)
    bounds = torch.arange(num_local + 1, device=ids.device, dtype=local.dtype)
    offsets = torch.searchsorted(local[order], bounds)  # first row of each expert, then the end
    gate_up = gemm13(x.index_select(0, order // k), offsets)
    inter = gate_up.shape[1] // 2
    partial = gemm2(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], offsets)
    partial = torch.where(held[order].unsqueeze(-1), partial, 0.0)  # rows past the last group
    unsorted = torch.empty_like(partial)
    unsorted[order] = partial
    return torch.bmm(weights.to(x.dtype).unsqueeze(1), unsorted.view(t, k, x.shape[1])).squeeze(1)


def moe_grouped_mm(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    expert_offset: int = 0,
) -> torch.Tensor:
    """`moe_grouped` with the per-expert loop replaced by two `F.grouped_mm` calls (their group end
    offsets are `_grouped_on_device`'s offsets[1:])."""

    def gemm(w: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        return lambda rows, offsets: F.grouped_mm(rows, w.transpose(-2, -1), offs=offsets[1:].to(torch.int32))

    return _grouped_on_device(x, weights, ids, expert_offset, w13.shape[0], gemm(w13), gemm(w2))


def moe_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    expert_offset: int = 0,
) -> torch.Tensor:
    """`moe_grouped_mm` with kernels/triton_moe.py's grouped GEMM (any float dtype)."""
    from kvpilot.kernels import triton_moe

    def gemm(w: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        return lambda rows, offsets: triton_moe.grouped_expert_gemm(rows, w, offsets)

    return _grouped_on_device(x, weights, ids, expert_offset, w13.shape[0], gemm(w13), gemm(w2))


MOE_BACKENDS = ("grouped", "grouped_mm", "triton")


def moe_backend_name(
    device_type: str, dtype: torch.dtype, quantized: bool, have_triton: bool, grouped_mm_ok: bool
) -> str:
    """Pure: how a layer's experts run. On CUDA torch's `grouped_mm` (CUTLASS) where it applies
    (bfloat16, SM >= 80), the Triton grouped GEMM for the other dtypes (float16, float32) or older
    GPUs; both keep the offsets on the device (CUDA graphs). Quantized experts and the CPU: one
    matmul pair per active expert (`moe_grouped`; qlinear's kernel for quantized experts), as is
    CUDA without Triton outside grouped_mm's case. scripts/gpu_check.sh times grouped_mm against
    Triton on the Mixtral-shaped model, so the bfloat16 default can follow the measurement."""
    if quantized or device_type != "cuda":
        return "grouped"
    if dtype == torch.bfloat16 and grouped_mm_ok:
        return "grouped_mm"
    return "triton" if have_triton else "grouped"


def _grouped_mm_ok(device: torch.device) -> bool:
    return hasattr(F, "grouped_mm") and torch.cuda.get_device_capability(device) >= (8, 0)


def _triton_available() -> bool:
    from kvpilot.kernels import triton_moe

    return triton_moe.available()


_BACKEND_FNS = {"grouped": moe_grouped, "grouped_mm": moe_grouped_mm, "triton": moe_triton}


def _new_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class FusedMoE(HoldsQuantized):
    """The experts of one layer, stacked: w13 [E_here, 2 * I_here, H] (gate rows, then up rows) and
    w2 [E_here, H, I_here]. Loads per-expert checkpoint tensors with shard_id (expert, piece)."""

    held = ("q13", "q2")  # one QuantizedWeight per expert once quantized

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_world_size()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.expert_parallel = expert_parallel_enabled() and self.tp_size > 1
        if self.expert_parallel:
            self.num_local_experts = divide(num_experts, self.tp_size)
            self.expert_offset = self.tp_rank * self.num_local_experts
            self.intermediate_per_rank = intermediate_size
        else:
            self.num_local_experts = num_experts
            self.expert_offset = 0
            self.intermediate_per_rank = divide(intermediate_size, self.tp_size)
        i = self.intermediate_per_rank
        self.w13 = _new_param(self.num_local_experts, 2 * i, hidden_size)
        self.w2 = _new_param(self.num_local_experts, hidden_size, i)
        for p in (self.w13, self.w2):
            p.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        # set by `quantize` (runtime/load/quantization.py), which frees w13 and w2
        self.q13: list[QuantizedWeight] | None = None
        self.q2: list[QuantizedWeight] | None = None
        self._table: tuple[int, qlinear.ExpertTable | None] | None = None  # (id of q13, its table)
        # None: chosen per input by `moe_backend_name`; one of MOE_BACKENDS to force it (tests, benchmarks)
        self.backend: str | None = None
        # False: the `grouped` backend always runs its per-expert torch loop (tests, benchmarks)
        self.use_cpu_kernel = True
        self.last_path = ""  # what the last forward ran: a backend name, "cpu_fused" or "quantized_fused"

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        expert, piece = shard_id
        local = int(expert) - self.expert_offset
        if not 0 <= local < self.num_local_experts:
            return  # another rank's expert
        i = self.intermediate_per_rank
        src_start = 0 if self.expert_parallel else self.tp_rank * i
        if piece == "w2":
            src, dst = loaded_weight.narrow(1, src_start, i), param.data[local]
        elif piece in ("w1", "w3"):
            src = loaded_weight.narrow(0, src_start, i)
            dst = param.data[local].narrow(0, 0 if piece == "w1" else i, i)
        else:
            raise ValueError(f"expert piece must be one of {EXPERT_PIECES}, got {piece!r}")
        if dst.shape != src.shape:
            raise ValueError(
                f"shape mismatch: expert {expert} {piece} shard {tuple(dst.shape)}, checkpoint {tuple(src.shape)}"
            )
        dst.copy_(src)

    def quantization_problem(self, method: str, group_size: int) -> str | None:
        """Why these experts cannot take `method` (None when they can): both matmuls' input widths
        (hidden for w13, this rank's intermediate for w2) must fit the int4 group."""
        if self.q13 is not None:
            return "already quantized"
        return qlinear.check_shape(method, self.hidden_size, group_size) or qlinear.check_shape(
            method, self.intermediate_per_rank, group_size
        )

    def quantize(self, method: str, group_size: int) -> tuple[int, int]:
        """Each held expert's w13 and w2 -> QuantizedWeight (int8 per output channel, int4 per group
        of `group_size`); the 16/32-bit stacks are freed. Returns (bytes before, bytes after)."""
        reason = self.quantization_problem(method, group_size)
        if reason:
            raise ValueError(f"--quantization {method}: experts: {reason}")
        w13, w2 = self.w13.data, self.w2.data
        self.q13 = [qlinear.quantize(w13[e], method, group_size) for e in range(self.num_local_experts)]
        self.q2 = [qlinear.quantize(w2[e], method, group_size) for e in range(self.num_local_experts)]
        before = (w13.numel() + w2.numel()) * w13.element_size()
        after = sum(q.nbytes for q in self.q13 + self.q2)
        self.w13 = None  # type: ignore[assignment]
        self.w2 = None  # type: ignore[assignment]
        return before, after

    def expert_table(self) -> qlinear.ExpertTable | None:
        """The quantized experts' pointer table for qlinear.fused_experts (one C call for the whole
        layer on CPU), built once per set of quantized experts; None when they cannot take it."""
        if self.q13 is None or self.q2 is None:
            return None
        if self._table is None or self._table[0] != id(self.q13):
            self._table = (id(self.q13), qlinear.expert_table(self.q13, self.q2))
        return self._table[1]

    def backend_for(self, x: torch.Tensor) -> str:
        """The backend this input runs on (`self.backend` when set, else `moe_backend_name`)."""
        if self.backend is not None:
            if self.backend not in MOE_BACKENDS:
                raise ValueError(f"MoE backend must be one of {MOE_BACKENDS}, got {self.backend!r}")
            if self.q13 is not None and self.backend != "grouped":
                raise ValueError(f"quantized experts run on the 'grouped' backend, not {self.backend!r}")
            return self.backend
        cuda = x.device.type == "cuda"
        return moe_backend_name(
            x.device.type,
            x.dtype,
            self.q13 is not None,
            cuda and _triton_available(),
            cuda and _grouped_mm_ok(x.device),
        )

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum (the caller all-reduces), on `backend_for(x)`: on CUDA a grouped
        GEMM that never synchronizes with the host (CUDA graphs); on the CPU one fused C call for
        the layer where it applies (kernels/cpu_moe.py for 16/32-bit experts, qlinear.fused_experts
        for quantized ones), else one matmul pair per active expert. `last_path` records which ran."""
        name = self.backend_for(x)
        if self.q13 is not None and self.q2 is not None:
            table = self.expert_table()
            fused = (
                None if table is None else qlinear.fused_experts(x, table, weights, ids, self.expert_offset)
            )
            self.last_path = "grouped" if fused is None else "quantized_fused"
            return (
                fused
                if fused is not None
                else moe_grouped(x, self.q13, self.q2, weights, ids, self.expert_offset)
            )
        # assignments expected on the experts held here (all of them without expert parallelism)
        held = ids.numel() * self.num_local_experts / self.num_experts
        if name == "grouped" and self.use_cpu_kernel and cpu_moe.applies(x, self.w13, held):
            self.last_path = "cpu_fused"
            return cpu_moe.fused_experts(x, self.w13, self.w2, weights, ids, self.expert_offset)
        self.last_path = name
        return _BACKEND_FNS[name](x, self.w13, self.w2, weights, ids, self.expert_offset)


class ReplicatedLinear(nn.Module):
    """A small linear every rank holds whole (the router, the shared-expert gate)."""

    def __init__(self, input_size: int, output_size: int) -> None:
        super().__init__()
        self.weight = _new_param(output_size, input_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class SharedExpert(nn.Module):
    """Qwen2-MoE's always-on expert, tensor-parallel like the dense MLP."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size, intermediate_size])
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    """Router -> top-k experts (+ Qwen2-MoE's shared expert, scaled by sigmoid(its gate))."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
        shared_intermediate_size: int = 0,
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = ReplicatedLinear(hidden_size, num_experts)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size)
        self.shared_expert: SharedExpert | None = None
        self.shared_expert_gate: ReplicatedLinear | None = None
        if shared_intermediate_size:
            self.shared_expert = SharedExpert(hidden_size, shared_intermediate_size)
            self.shared_expert_gate = ReplicatedLinear(hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        out = tp_all_reduce(self.experts(x, weights, ids))
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
