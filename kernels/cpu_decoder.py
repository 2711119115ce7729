"""A stack of decoder layers in one C call (kernels/csrc/decoder_cpu.c), for CPU steps of few tokens.

The C code only orders the calls: it runs the very kernels the Python layers run (fused RMSNorm,
rotary, KV write, paged attention, silu(g) * u, the tiled quantized matmul), passed to it as
function pointers from their own libraries. This module holds the C structs (as
kernels/csrc/kvpilot_kernels.h declares them; tests/kernels/test_c_abi.py compares the two) and the
call; which models and steps may take it is runtime/models/cpu_stack.py's decision.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch

from kvpilot.kernels import cbuild, cpu_attention, cpu_ops, qlinear
from kvpilot.kernels.qlinear import QuantizedWeight

SOURCE = Path(__file__).parent / "csrc" / "decoder_cpu.c"
CFLAGS = ["-O2", "-fno-fast-math", "-ffp-contract=off", "-fPIC", "-shared", "-std=gnu11"]
DTYPES = cpu_ops.ACTIVATION_CODES
_p, _i, _l, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float


class Linear(ctypes.Structure):
    _fields_ = [
        ("codes", _p),
        ("scales", _p),
        ("mins", _p),
        ("bias", _p),
        ("out_features", _l),
        ("in_features", _l),
        ("bits", _i),
        ("group", _i),
    ]


class Layer(ctypes.Structure):
    _fields_ = [
        ("norm1", _p),
        ("norm2", _p),
        ("eps1", _f),
        ("eps2", _f),
        ("qkv", Linear),
        ("o", Linear),
        ("gate_up", Linear),
        ("down", Linear),
        ("k_cache", _p),
        ("v_cache", _p),
        ("k_strides", _l * 4),
        ("v_strides", _l * 4),
        ("k_scale", _p),
        ("v_scale", _p),
        ("q_norm", _p),
        ("k_norm", _p),
        ("qk_eps", _f),
    ]


class Step(ctypes.Structure):
    _fields_ = [
        ("rms_norm", _p),
        ("rotary", _p),
        ("write_kv", _p),
        ("attention", _p),
        ("silu_mul", _p),
        ("qmatmul", _p),
        ("dtype", _i),
        ("num_heads", _i),
        ("num_kv_heads", _i),
        ("head_dim", _i),
        ("rotary_dim", _i),
        ("kv_dtype", _i),
        ("k_transposed", _i),
        ("v_head_major", _i),
        ("block_size", _i),
        ("max_blocks", _i),
        ("num_seqs", _i),
        ("num_threads", _i),
        ("allow_fast", _i),
        ("num_slots", _l),
        ("max_position", _l),
        ("sm_scale", _f),
        ("positions", _p),
        ("slots", _p),
        ("cos_sin", _p),
        ("block_tables", _p),
        ("query_start_loc", _p),
        ("seq_lens", _p),
    ]


def _declare(lib: ctypes.CDLL) -> None:
    lib.kvpilot_decoder_stack.argtypes = [
        ctypes.POINTER(Step), ctypes.POINTER(Layer), _i, _p, _p, _l, _l,
    ]  # fmt: skip
    lib.kvpilot_decoder_stack.restype = _i


EXTENSION = cbuild.Extension(SOURCE, CFLAGS, _declare, "running the layers one by one")
STAGES = {1: "rms_norm", 2: "qkv_proj", 3: "rotary", 4: "write_kv", 5: "attention", 6: "o_proj", 7: "gate_up_proj", 8: "down_proj", 9: "silu_mul"}  # fmt: skip


def available() -> bool:
    """The stack and every library it calls can be built (and the CPU has the tiled kernel)."""
    return (
        EXTENSION.available()
        and cpu_ops.available()
        and cpu_attention.available()
        and qlinear.available()
        and qlinear.built_isa() in ("avx512", "avx2")
    )


def kernels() -> dict[str, int]:
    """The addresses of the kernels the stack calls (the libraries loaded for isa.selected())."""
    ops, att, qmm = (
        cpu_ops.EXTENSION.library(),
        cpu_attention.EXTENSION.library(),
        qlinear.EXTENSION.library(),
    )

    def address(fn: Any) -> int:
        value = ctypes.cast(fn, ctypes.c_void_p).value
        assert value is not None
        return value

    return {
        "rms_norm": address(ops.kvpilot_rms_norm),
        "rotary": address(ops.kvpilot_rotary),
        "write_kv": address(ops.kvpilot_write_kv),
        "attention": address(att.kvpilot_paged_attention),
        "silu_mul": address(ops.kvpilot_silu_mul),
        # the tiled kernel of the qmatmul_activations switch (kernels/switches.py)
        "qmatmul": address(qlinear.tiled_kernel(qmm)),
    }


def linear(qw: QuantizedWeight, bias: torch.Tensor | None) -> Linear:
    """A tiled quantized weight (and bias, in the activations' dtype) as the C struct."""
    assert qw.tiled
    return Linear(
        qw.packed.data_ptr(),
        qw.scales.data_ptr(),
        None if qw.mins is None else qw.mins.data_ptr(),
        None if bias is None else bias.data_ptr(),
        qw.out_features,
        qw.in_features,
        qw.bits,
        qw.group,
    )


def run(step: Step, layers: ctypes.Array[Layer], hidden: torch.Tensor, residual: torch.Tensor) -> None:
    """Run the layers over hidden [T, H] in place (out: the last MLP's output); residual [T, H] gets
    the running residual. Raises ValueError naming the stage whose kernel refused its arguments."""
    t, h = hidden.shape
    rc = EXTENSION.library().kvpilot_decoder_stack(
        ctypes.byref(step), layers, len(layers), hidden.data_ptr(), residual.data_ptr(), t, h
    )
    if rc != 0:
        stage = STAGES.get(rc // 100, "arguments") if rc > 0 else "arguments"
        raise ValueError(f"decoder stack: the {stage} kernel rejected its arguments (code {rc})")
