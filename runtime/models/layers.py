"""Building blocks for decoder-only models, tensor-parallel from the start.

Each parallel layer owns this rank's shard of its weights. Every parameter carries a
`weight_loader(param, loaded_weight, shard_id=None)` that receives the *full* checkpoint tensor and
copies in the slice this rank keeps, so checkpoint formats never need to know about sharding. At
tensor-parallel world size 1 the layers are plain linears/embeddings.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.kernels import cpu_ops, qlinear
from kvpilot.kernels.qlinear import QuantizedWeight
from kvpilot.runtime.models.parallel import (
    divide,
    get_tp_rank,
    get_tp_world_size,
    tp_all_gather,
    tp_all_reduce,
)

WeightLoader = Callable[..., None]


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
    """Copy a replicated (unsharded) tensor; shapes must agree exactly."""
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded_weight.shape)}"
        )
    param.data.copy_(loaded_weight)


def set_weight_loader(param: nn.Parameter, loader: WeightLoader) -> None:
    param.weight_loader = loader  # type: ignore[attr-defined]


def get_weight_loader(param: nn.Parameter) -> WeightLoader:
    loader: WeightLoader = getattr(param, "weight_loader", default_weight_loader)
    return loader


def _new_param(*shape: int) -> nn.Parameter:
    # Uninitialized: every parameter is overwritten by a weight loader.
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


_defer_linear_weights = False


@contextmanager
def deferred_linear_weights() -> Iterator[None]:
    """Build linear layers with their weight on the meta device (no memory): a GPTQ/AWQ checkpoint
    then sets each layer's quantized weight instead (runtime/load/loader.py)."""
    global _defer_linear_weights
    before, _defer_linear_weights = _defer_linear_weights, True
    try:
        yield
    finally:
        _defer_linear_weights = before


def _new_linear_weight(*shape: int) -> nn.Parameter:
    if _defer_linear_weights:
        return nn.Parameter(torch.empty(*shape, device="meta"), requires_grad=False)
    return _new_param(*shape)


def _copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(
            f"shape mismatch: parameter shard {tuple(dst.shape)}, checkpoint shard {tuple(src.shape)}"
        )
    dst.copy_(src)


# ---------------------------------------------------------------------------------------------
# Norms and activations


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 (as transformers does), optionally fused with the residual add."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (norm(x + residual), x + residual); without a residual, (norm(x), x)."""
        if cpu_ops.supports(x, self.weight, *(() if residual is None else (residual,))):
            return cpu_ops.rms_norm(x, self.weight, self.eps, residual)  # same rounding, one call
        if residual is not None:
            x = x + residual
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype), x


class SiluAndMul(nn.Module):
    """[..., 2 * d] (gate, up) -> silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_ops.supports(x):
            return cpu_ops.silu_mul(x)  # one call; the C decoder stack calls the same
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


# ---------------------------------------------------------------------------------------------
# Rotary position embedding


def rope_inv_freq(rotary_dim: int, base: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [rotary_dim / 2], float32, with `default`, `linear` or `llama3` scaling."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    inv_freq = 1.0 / (base**exponents)
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    assert scaling is not None
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: default, linear, llama3)")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate smoothly between.
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotate-half (GPT-NeoX / HF Llama layout) rotary embedding over per-token positions.

    The cos/sin table is float32 and sized for `max_position` positions; it is cast to the query dtype
    when applied, as transformers does.
    """

    cos_sin_cache: torch.Tensor  # [max_position, rotary_dim]: cos of each frequency, then sin

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        scaling: dict[str, Any] | None = None,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        self.max_position = max_position
        self.base = base
        self.scaling = scaling
        table = self._table(None).to(torch.get_default_device())
        self.register_buffer("cos_sin_cache", table, persistent=False)

    def _table(self, freq_factors: torch.Tensor | None) -> torch.Tensor:
        # Computed on the CPU in float32 whatever the model's device and dtype, then moved.
        with torch.device("cpu"):
            inv_freq = rope_inv_freq(self.rotary_dim, self.base, self.scaling)
            if freq_factors is not None:
                inv_freq = inv_freq / freq_factors.to(device="cpu", dtype=torch.float32)
            t = torch.arange(self.max_position, dtype=torch.float32)
            freqs = torch.outer(t, inv_freq)
            return torch.cat([freqs.cos(), freqs.sin()], dim=-1)

    def set_freq_factors(self, freq_factors: torch.Tensor) -> None:
        """llama.cpp's `rope_freqs` tensor: per-frequency divisors (Llama 3.1 GGUFs)."""
        device = self.cos_sin_cache.device
        self.cos_sin_cache = self._table(freq_factors).to(device)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D] -> rotated (on CPU in place, in one fused call)."""
        if cpu_ops.rotary_supports(q, k):
            cpu_ops.rotary_(q, k, positions, self.cos_sin_cache, self.rotary_dim)
            return q, k
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)  # [T, rotary_dim / 2] each
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cos = cos.to(x.dtype).unsqueeze(-2)
        sin = sin.to(x.dtype).unsqueeze(-2)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        x1, x2 = rot.chunk(2, dim=-1)
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        return torch.cat([out, rest], dim=-1) if rest.numel() else out


# ---------------------------------------------------------------------------------------------
# Linear layers


# ---------------------------------------------------------------------------------------------
# Quantized weights loaded from a checkpoint's own blocks (runtime/quantization.prepare_blocks)

Loaded = torch.Tensor | QuantizedWeight  # what a weight loader receives: a float tensor or blocks


def narrow_qweight(qw: QuantizedWeight, dim: int, start: int, size: int) -> QuantizedWeight:
    """Rows (dim 0) or input columns (dim 1, whole groups only) of a quantized weight, as views."""
    if qw.tiled:
        raise ValueError("a tiled quantized weight cannot be narrowed (tile after loading shards)")
    if dim == 0:
        return QuantizedWeight(
            qw.bits, qw.group, qw.packed.narrow(0, start, size), qw.scales.narrow(0, start, size),
            None if qw.mins is None else qw.mins.narrow(0, start, size), size, qw.in_features,
        )  # fmt: skip
    g = qw.group
    if start % g or size % g:
        raise ValueError(f"columns {start}..{start + size} do not fall on the quantization group size {g}")
    per_byte = 8 // qw.bits
    return QuantizedWeight(
        qw.bits, g, qw.packed.narrow(1, start // per_byte, size // per_byte),
        qw.scales.narrow(1, start // g, size // g),
        None if qw.mins is None else qw.mins.narrow(1, start // g, size // g), qw.out_features, size,
    )  # fmt: skip


def empty_qweight(bits: int, group: int, rows: int, cols: int, device: torch.device) -> QuantizedWeight:
    """An uninitialized quantized weight [rows, cols] to load blocks into (like an empty parameter,
    every row is written by a weight loader; the embedding's loader zeroes its padding rows)."""
    packed = torch.empty(
        rows, cols * bits // 8, dtype=torch.int8 if bits == 8 else torch.uint8, device=device
    )
    scales = torch.empty(rows, cols // group, dtype=torch.float16, device=device)
    mins = None if bits == 8 else torch.empty_like(scales)
    return QuantizedWeight(bits, group, packed, scales, mins, rows, cols)


def copy_qweight(dst: QuantizedWeight, src: QuantizedWeight) -> None:
    """Copy blocks into a (narrowed) loaded weight; format and shape must agree."""
    if (dst.bits, dst.group) != (src.bits, src.group):
        raise ValueError(
            f"quantized format mismatch: layer holds {dst.bits}-bit group {dst.group}, "
            f"checkpoint has {src.bits}-bit group {src.group}"
        )
    _copy_checked(dst.packed, src.packed)
    _copy_checked(dst.scales, src.scales)
    if dst.mins is not None and src.mins is not None:
        dst.mins.copy_(src.mins)


def _narrow(w: Loaded, dim: int, start: int, size: int) -> Loaded:
    return (
        narrow_qweight(w, dim, start, size) if isinstance(w, QuantizedWeight) else w.narrow(dim, start, size)
    )


def _copy_loaded(dst: Loaded, src: Loaded) -> None:
    if isinstance(dst, QuantizedWeight) != isinstance(src, QuantizedWeight):
        raise ValueError(
            "a layer prepared for quantized blocks got a float tensor, or a float layer got blocks"
        )
    if isinstance(dst, QuantizedWeight):
        assert isinstance(src, QuantizedWeight)
        copy_qweight(dst, src)
    else:
        assert isinstance(src, torch.Tensor)
        _copy_checked(dst, src)


def _target(param: nn.Parameter, qweight: QuantizedWeight | None) -> Loaded:
    """Where a loader writes: the prepared quantized weight for a blocks stand-in, else the parameter."""
    if param.device.type == "meta":
        if qweight is None:
            raise ValueError("a weight prepared for quantized blocks has no quantized storage")
        return qweight
    return param.data


def blocks_param(weight: nn.Parameter) -> nn.Parameter:
    """A stand-in for a weight that will arrive as blocks: same shape and loader, no memory (meta)."""
    param = nn.Parameter(torch.empty(weight.shape, device="meta", dtype=weight.dtype), requires_grad=False)
    set_weight_loader(param, get_weight_loader(weight))
    return param


def _linear(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    qweight: QuantizedWeight | None,
    bias: torch.Tensor | None,
    input_perm: torch.Tensor | None = None,
) -> torch.Tensor:
    """F.linear, or the weight-only quantized matmul once the layer's weight has been quantized
    (with the input features gathered by `input_perm` first for a GPTQ act-order weight)."""
    if qweight is not None:
        if input_perm is not None:
            x = x.index_select(-1, input_perm)
        return qlinear.matmul(x, qweight, bias)
    assert weight is not None
    if weight.dtype != x.dtype:  # 16-bit weights under float32 activations (store_linear_weights)
        y = F.linear(x.to(weight.dtype), weight).to(x.dtype)
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


def store_linear_weights(model: nn.Module, dtype: torch.dtype) -> int:
    """Store every float (not quantized) weight of the model's linear layers in `dtype`, the
    activations and everything else unchanged: `_linear` then rounds each matmul's input to `dtype`
    and its output back, with the bias added in the activations' dtype. Returns how many it cast."""
    n = 0
    for module in model.modules():
        if not isinstance(module, ColumnParallelLinear | RowParallelLinear):
            continue
        if module.qweight is None and module.weight.is_floating_point() and module.weight.dtype != dtype:
            module.weight.data = module.weight.data.to(dtype)
            n += 1
    return n


class HoldsQuantized(nn.Module):
    """A module whose quantized weights (kernels/qlinear.QuantizedWeight: plain attributes, not
    parameters) follow `.to(device)`, `.cuda()` and `.cpu()` as its parameters do. They move in place,
    so that modules sharing one (a tied LM head and embedding) still share it; a dtype change leaves
    them as they are (their scales stay float16, their codes integers)."""

    held: tuple[str, ...] = ("qweight",)  # attributes: a QuantizedWeight, a list of them, or a tensor

    def _held(self) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        """(attribute, a tensor or one QuantizedWeight) for everything held, lists flattened."""
        for name in self.held:
            value = getattr(self, name, None)
            for item in value if isinstance(value, list) else [value]:
                if isinstance(item, torch.Tensor | QuantizedWeight):
                    yield name, item

    def held_tensors(self) -> Iterator[torch.Tensor]:
        for _, item in self._held():
            yield from [item] if isinstance(item, torch.Tensor) else item.tensors()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> HoldsQuantized:
        super()._apply(fn, recurse)
        for name, item in list(self._held()):
            if isinstance(item, torch.Tensor):
                setattr(self, name, item.to(_device_after(fn, item)))
            else:
                item.move_(_device_after(fn, item.packed))
        return self


def _device_after(fn: Callable[[torch.Tensor], torch.Tensor], like: torch.Tensor) -> torch.device:
    """Where `fn` (what Module.to/cuda/cpu apply to each tensor) puts an integer tensor from `like`'s device."""
    return fn(torch.empty(0, dtype=torch.uint8, device=like.device)).device


def resident_bytes(model: nn.Module) -> int:
    """Bytes of the model's own tensors (parameters, buffers, quantized weights), each storage once."""
    seen: dict[tuple[torch.device, int], int] = {}
    tensors: list[torch.Tensor] = [*model.parameters(), *model.buffers()]
    for module in model.modules():
        if isinstance(module, HoldsQuantized):
            tensors.extend(module.held_tensors())
    for t in tensors:
        if t.device.type != "meta" and t.numel():
            storage = t.untyped_storage()
            seen[(t.device, storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


class ColumnParallelLinear(HoldsQuantized):
    """y = x W^T + b with W split along its output rows; each rank holds output_size / tp rows."""

    held = ("qweight", "input_perm")

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, gather_output: bool = False
    ) -> None:
        super().__init__()
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_world_size()
        self.input_size = input_size
        self.output_size = output_size
        self.output_size_per_rank = divide(output_size, self.tp_size)
        self.gather_output = gather_output
        self.lora: Any = None  # runtime/lora/layers.LoRALinear once LoRA serving attaches one
        self.weight = _new_linear_weight(self.output_size_per_rank, input_size)
        set_weight_loader(self.weight, self.weight_loader)
        self.qweight: QuantizedWeight | None = None  # set by runtime/load/quantization.py
        self.input_perm: torch.Tensor | None = None  # GPTQ act-order: qweight's input feature order
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = _new_param(self.output_size_per_rank)
            set_weight_loader(self.bias, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded_weight: Loaded, shard_id: Any = None) -> None:
        size = param.shape[0]
        _copy_loaded(_target(param, self.qweight), _narrow(loaded_weight, 0, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _linear(x, self.weight, self.qweight, self.bias, self.input_perm)
        if self.lora is not None:
            y = self.lora.add_delta(x, y)
        return tp_all_gather(y, dim=-1) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel linears fused into one matmul (gate_proj and up_proj -> gate_up_proj).

    Each rank's weight is [shard_0 / tp; shard_1 / tp; ...]; `shard_id` is the index of the piece.
    """

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(self.output_sizes), bias=bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: Loaded, shard_id: Any = None) -> None:
        if shard_id is None:
            raise ValueError("MergedColumnParallelLinear needs the shard index of the loaded piece")
        index = int(shard_id)
        size = self.output_sizes[index] // self.tp_size
        offset = sum(self.output_sizes[:index]) // self.tp_size
        dst = _narrow(_target(param, self.qweight), 0, offset, size)
        _copy_loaded(dst, _narrow(loaded_weight, 0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection. Heads are split across ranks; when there are fewer KV heads than ranks,
    each KV head is replicated on tp / num_kv_heads ranks."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
    ) -> None:
        tp_size = get_tp_world_size()
        self.head_dim = head_dim
        self.num_heads = divide(total_num_heads, tp_size)
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads = 1
            self.kv_replicas = divide(tp_size, total_num_kv_heads)
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size)
            self.kv_replicas = 1
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, output_size, bias=bias)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def weight_loader(self, param: nn.Parameter, loaded_weight: Loaded, shard_id: Any = None) -> None:
        if shard_id == "q":
            offset, size, src = 0, self.q_size, self.tp_rank * self.q_size
        elif shard_id == "k":
            offset, size, src = self.q_size, self.kv_size, (self.tp_rank // self.kv_replicas) * self.kv_size
        elif shard_id == "v":
            offset, size = self.q_size + self.kv_size, self.kv_size
            src = (self.tp_rank // self.kv_replicas) * self.kv_size
        else:
            raise ValueError(f"QKVParallelLinear shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        _copy_loaded(
            _narrow(_target(param, self.qweight), 0, offset, size), _narrow(loaded_weight, 0, src, size)
        )


class RowParallelLinear(HoldsQuantized):
    """y = x W^T + b with W split along its input columns; partial products are summed across ranks."""

    held = ("qweight", "input_perm")

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_world_size()
        self.input_size_per_rank = divide(input_size, self.tp_size)
        self.output_size = output_size
        self.lora: Any = None  # runtime/lora/layers.LoRALinear once LoRA serving attaches one
        self.weight = _new_linear_weight(output_size, self.input_size_per_rank)
        set_weight_loader(self.weight, self.weight_loader)
        self.qweight: QuantizedWeight | None = None  # set by runtime/load/quantization.py
        self.input_perm: torch.Tensor | None = None  # GPTQ act-order: qweight's input feature order
        self.bias: nn.Parameter | None = None
        if bias:  # replicated: added once, after the reduction
            self.bias = _new_param(output_size)
            set_weight_loader(self.bias, default_weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded_weight: Loaded, shard_id: Any = None) -> None:
        size = param.shape[1]
        _copy_loaded(_target(param, self.qweight), _narrow(loaded_weight, 1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            y = _linear(x, self.weight, self.qweight, self.bias, self.input_perm)
            return y if self.lora is None else self.lora.add_delta(x, y)
        y = _linear(x, self.weight, self.qweight, None, self.input_perm)
        if self.lora is not None:  # this rank's partial LoRA product joins the all-reduce
            y = self.lora.add_delta(x, y)
        y = tp_all_reduce(y)
        return y + self.bias if self.bias is not None else y


# ---------------------------------------------------------------------------------------------
# Embedding and LM head


def lookup_rows(qw: QuantizedWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Embedding lookup in a quantized table: only the looked-up rows are dequantized."""
    flat = ids.reshape(-1)
    if qw.tiled:
        return qlinear.tiled_rows(qw, flat).dequantize(dtype).reshape(*ids.shape, qw.in_features)
    rows = QuantizedWeight(
        qw.bits, qw.group, qw.packed.index_select(0, flat), qw.scales.index_select(0, flat),
        None if qw.mins is None else qw.mins.index_select(0, flat), flat.numel(), qw.in_features,
    )  # fmt: skip
    return rows.dequantize(dtype).reshape(*ids.shape, qw.in_features)


class VocabParallelEmbedding(HoldsQuantized):
    """Embedding rows split across ranks (vocabulary padded up to a multiple of the world size)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_world_size()
        self.num_embeddings = num_embeddings
        self.rows_per_rank = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, num_embeddings)
        self.weight = _new_param(self.rows_per_rank, embedding_dim)
        set_weight_loader(self.weight, self.weight_loader)
        self.dtype = self.weight.dtype  # of the embeddings handed out, whatever the storage
        # Set by runtime/load/quantization.py (the quantized LM head; the tied embedding shares it):
        # a lookup then dequantizes only the rows it reads.
        self.qweight: QuantizedWeight | None = None

    def weight_loader(self, param: nn.Parameter, loaded_weight: Loaded, shard_id: Any = None) -> None:
        full = (
            loaded_weight.out_features
            if isinstance(loaded_weight, QuantizedWeight)
            else loaded_weight.shape[0]
        )
        if full != self.num_embeddings:
            raise ValueError(
                f"embedding has {full} rows in the checkpoint, the model expects "
                f"{self.num_embeddings} (vocab_size)"
            )
        rows = self.vocab_end - self.vocab_start
        dst = _target(param, self.qweight)
        if isinstance(dst, QuantizedWeight):  # rows past the vocabulary (on the last rank) are zeros
            for part in (dst.packed, dst.scales, dst.mins):
                if part is not None:
                    part[rows:].zero_()
        else:
            dst[rows:].zero_()
        _copy_loaded(_narrow(dst, 0, 0, rows), _narrow(loaded_weight, 0, self.vocab_start, rows))

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.qweight is None:
            return F.embedding(ids, self.weight)
        return lookup_rows(self.qweight, ids, self.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(input_ids)
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(mine, input_ids - self.vocab_start, torch.zeros_like(input_ids))
        out = self._lookup(local) * mine.unsqueeze(-1).to(self.dtype)
        return tp_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection with the vocabulary split across ranks; logits are gathered on every rank."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = (
            F.linear(hidden, self.weight) if self.qweight is None else qlinear.matmul(hidden, self.qweight)
        )
        if self.tp_size > 1:
            logits = tp_all_gather(logits, dim=-1)
        return logits[..., : self.num_embeddings]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is used through compute_logits(), not as an embedding")
