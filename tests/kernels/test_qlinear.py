"""Weight-only int8/int4 matmuls (kernels/qlinear.py): the formats, and the C kernel at every ISA level
against its specification (avx512/avx2: int8 activation blocks, `reference_q8_matmul`; generic:
dequantize, then matmul) and against the float product."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvpilot.kernels import cbuild, isa, qlinear, switches
from tests.needs import missing


def weight(n: int = 96, k: int = 256) -> torch.Tensor:
    torch.manual_seed(0)
    w = torch.randn(n, k) * 0.05
    w[3] = 0.0  # an all-zero row: scale 0 must not turn into NaN
    w[5, :32] = 0.7  # a constant group
    return w


def test_int8_per_channel_round_trip_is_within_half_a_step() -> None:
    w = weight()
    qw = qlinear.quantize_int8(w)
    assert qw.packed.dtype == torch.int8 and qw.scales.shape == (96, 1) and qw.group == 256
    err = (qw.dequantize() - w).abs()
    assert bool((err <= qw.scales.float() * 0.5 + 1e-6).all())
    assert torch.equal(qw.dequantize()[3], torch.zeros(256))
    assert qw.nbytes == 96 * 256 + 96 * 2  # 1 byte a weight plus a float16 scale a row


@pytest.mark.parametrize("group", qlinear.INT4_GROUPS)
def test_int4_group_round_trip_is_within_half_a_step(group: int) -> None:
    w = weight()
    qw = qlinear.quantize_int4(w, group)
    assert qw.packed.shape == (96, 128) and qw.scales.shape == (96, 256 // group)
    assert qw.mins is not None
    deq = qw.dequantize()
    step = qw.scales.float().repeat_interleave(group, dim=1)
    # half a step, plus the float16 rounding of the min
    assert bool(((deq - w).abs() <= step * 0.5 + w.abs() * 2e-3 + 1e-6).all())
    assert torch.equal(deq[3], torch.zeros(256))
    assert torch.allclose(deq[5, :32], torch.full((32,), 0.7), atol=1e-3)
    # the nibble order is GGUF's: weight i of a group in the low nibble of byte i, i + group/2 high
    q = (w[0, :group] - qw.mins[0, 0].float()) / qw.scales[0, 0].float()
    assert int(qw.packed[0, 0]) == int(q[0].round()) | (int(q[group // 2].round()) << 4)


def test_shapes_a_method_cannot_take_are_explained() -> None:
    assert qlinear.check_shape("int4", 256, 32) is None
    assert "not a multiple of the int4 group size 128" in str(qlinear.check_shape("int4", 192, 128))
    assert "group size must be one of 32, 64, 128" in str(qlinear.check_shape("int4", 256, 16))
    assert qlinear.check_shape("int8", 250, 32) is None  # per channel: any width
    with pytest.raises(ValueError, match="not a multiple"):
        qlinear.quantize_int4(torch.zeros(4, 48), 32)


CASES = [
    pytest.param(method, group, level, id=f"{method}{'-g' + str(group) if method == 'int4' else ''}-{level}")
    for level in isa.runnable()
    for method, group in (("int8", 0), ("int4", 32), ("int4", 64), ("int4", 128))
]


@pytest.mark.parametrize(("method", "group", "level"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 6, 16])  # the kernel takes x rows 4 at a time
def test_kernel_matches_the_dequantized_matmul(
    method: str, group: int, level: str, dtype: torch.dtype, rows: int
) -> None:
    if not qlinear.available(level):
        missing("a C compiler for the CPU kernels", "install gcc or clang")
    assert qlinear.built_isa(level) == level
    w = weight(96, 384)
    qw = qlinear.quantize(w, method, group or 32)
    torch.manual_seed(rows)
    x = torch.randn(rows, 384).to(dtype)
    bias = torch.randn(96).to(dtype)
    got = qlinear.kernel_matmul(x, qw, bias, level=level)
    assert got.dtype == dtype and got.shape == (rows, 96)
    exact = F.linear(x.float(), qw.dequantize(torch.float32), bias.float())
    if qlinear.q8_path_applies(qw, level):
        # the specification: int8 activation blocks, integer dots, float scales
        want = qlinear.reference_q8_matmul(x.float(), qw, bias.float())
        # and that is the float product up to the activations' rounding (amax / 254 per element)
        rel = (want - exact).norm() / exact.norm()
        assert 0 < rel < 0.01, rel
    else:
        want = exact
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    else:  # one bf16 rounding of the result (and of the input the activations are quantized from)
        torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=1e-2)
    # and the layer's entry point takes the kernel for this input (or, from GEMM_MIN_ROWS rows, the GEMM)
    if level == qlinear.built_isa():
        path = qlinear.gemm_matmul if qlinear.gemm_applies(x, qw) else qlinear.kernel_matmul
        torch.testing.assert_close(qlinear.matmul(x, qw, bias), path(x, qw, bias), rtol=0, atol=0)


@pytest.mark.parametrize("level", [lv for lv in isa.runnable() if lv != "generic"])
def test_int8_activation_path_across_block_layouts(level: str) -> None:
    """Every storage order the kernel reads (int4 groups 32/64/128, int8 per channel and per 32) on
    inputs with outliers, zero blocks and exact ties (x = k + 0.5 steps), against the specification."""
    if not qlinear.available(level):
        missing("a C compiler for the CPU kernels", "install gcc or clang")
    torch.manual_seed(7)
    w = weight(40, 512)
    x = torch.randn(5, 512)
    x[0, :64] = 0.0  # zero blocks: scale 0, codes 0
    x[1, 3] = 80.0  # one outlier dominates its block's scale
    x[2] = torch.arange(512).float() % 7 - 3.5  # ties at half steps
    for qw in (
        qlinear.quantize_int4(w, 32),
        qlinear.quantize_int4(w, 64),
        qlinear.quantize_int4(w, 128),
        qlinear.quantize_int8(w),
        qlinear.quantize_int8(w, 32),
    ):
        assert qlinear.q8_path_applies(qw, level)
        got = qlinear.kernel_matmul(x, qw, level=level)
        torch.testing.assert_close(got, qlinear.reference_q8_matmul(x, qw), rtol=1e-5, atol=1e-4)


def test_storage_order_is_a_permutation_matching_the_nibble_layout() -> None:
    w = weight(8, 256)
    qw = qlinear.quantize_int4(w, 128)
    order = qlinear.storage_order(qw)
    assert sorted(order.tolist()) == list(range(256))
    # codes in storage order, dequantized and put back in feature order, are the weight
    assert qw.mins is not None
    per_weight = qw.scales.float().repeat_interleave(128, 1), qw.mins.float().repeat_interleave(128, 1)
    deq = qlinear.codes(qw).float() * per_weight[0] + per_weight[1]  # groups keep their positions
    back = torch.empty_like(deq)
    back[:, order] = deq
    torch.testing.assert_close(back, qw.dequantize(torch.float32))


def test_kernel_takes_batched_leading_dims_and_large_m_falls_back_to_the_reference() -> None:
    qw = qlinear.quantize_int4(weight(), 32)
    x = torch.randn(2, 3, 256)
    assert qlinear.kernel_applies(x, qw) == qlinear.available()
    assert qlinear.matmul(x, qw).shape == (2, 3, 96)
    big = torch.randn(qlinear.SMALL_M + 1, 256)
    assert not qlinear.kernel_applies(big, qw)
    if qlinear.gemm_applies(big, qw):  # avx512 / avx2: the int8-activation GEMM
        assert torch.equal(qlinear.matmul(big, qw), qlinear.gemm_matmul(big, qw))
    else:
        assert torch.equal(qlinear.matmul(big, qw), qlinear.reference_matmul(big, qw))
    with pytest.raises(ValueError, match="input has 255 features"):
        qlinear.kernel_matmul(torch.randn(1, 255), qw)


@pytest.mark.usefixtures("exact_qmatmul")
def test_float_activations_give_the_exact_product() -> None:
    """--qmatmul-activations float: every level multiplies the dequantized weights in float32."""
    torch.manual_seed(3)
    x = torch.randn(3, 256)
    for level in isa.runnable():
        if not qlinear.available(level):
            missing("a C compiler for the CPU kernels", "install gcc or clang")
        for qw in (qlinear.quantize_int4(weight(), 64), qlinear.quantize_int8(weight())):
            assert not qlinear.q8_path_applies(qw, level)
            got = qlinear.kernel_matmul(x, qw, level=level)
            torch.testing.assert_close(got, qlinear.reference_matmul(x, qw), rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("exact_qmatmul")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_rows_dequantize_in_c_to_the_same_weights(dtype: torch.dtype) -> None:
    """With float activations the many-row path (prefill) dequantizes with the C library: the weights
    QuantizedWeight.dequantize gives (float32: to an ulp, FMA contraction; bfloat16: the same
    rounding), then torch's matmul."""
    if not qlinear.available():
        missing("a C compiler for the CPU kernels", "install gcc or clang")
    assert not qlinear.gemm_applies(torch.zeros(qlinear.SMALL_M + 3, 256), qlinear.quantize_int8(weight()))
    torch.manual_seed(4)
    x = torch.randn(qlinear.SMALL_M + 3, 256).to(dtype)
    bias = torch.randn(96).to(dtype)
    for qw in (
        qlinear.quantize_int4(weight(), 32),
        qlinear.quantize_int4(weight(), 128),
        qlinear.quantize_int8(weight()),
    ):
        assert not qlinear.kernel_applies(x, qw)
        got = qlinear.matmul(x, qw, bias)
        want = qlinear.reference_matmul(x, qw, bias)
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:
            torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


# ---------------------------------------------------------------------------------------------
# The tiled layout (qlinear.tile): 16 rows' codes interleaved for the CPU kernel


def _formats(w: torch.Tensor) -> list[qlinear.QuantizedWeight]:
    k = w.shape[1]
    return [qlinear.quantize_int8(w), qlinear.quantize_int8(w, 32)] + [
        qlinear.quantize_int4(w, g) for g in qlinear.INT4_GROUPS if k % g == 0
    ]


def test_tiling_is_a_permutation_that_untile_and_row_lookups_undo() -> None:
    w = weight(48, 256)
    for qw in _formats(w):
        t = qlinear.tile(qw)
        assert t.tiled and t.nbytes == qw.nbytes and t.packed.shape == qw.packed.shape
        assert not torch.equal(t.packed, qw.packed)  # the bytes did move
        assert sorted(t.packed.flatten().tolist()) == sorted(qw.packed.flatten().tolist())
        back = qlinear.untile(t)
        assert not back.tiled
        for a, b in ((back.packed, qw.packed), (back.scales, qw.scales), (back.mins, qw.mins)):
            assert (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
        rows = torch.tensor([0, 5, 17, 47, 5])
        picked = qlinear.tiled_rows(t, rows)
        torch.testing.assert_close(picked.dequantize(), qw.dequantize()[rows], rtol=0, atol=0)
        torch.testing.assert_close(t.dequantize(), qw.dequantize(), rtol=0, atol=0)
        # row 1's first block: in the tiled layout its first 4 bytes follow row 0's first 4
        assert torch.equal(t.packed.flatten()[4:8], qw.packed[1, :4])


@pytest.mark.parametrize("level", [lv for lv in isa.runnable() if lv != "generic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_kernel_matches_the_specification(level: str, dtype: torch.dtype) -> None:
    """Every format at every vector level, row counts around the kernel's 4-row passes, with bias,
    zero rows, constant groups and zero activation blocks: the same arithmetic as the row kernel."""
    if not qlinear.available(level):
        missing("a C compiler for the CPU kernels", "install gcc or clang")
    torch.manual_seed(11)
    w = weight(48, 512)
    bias = torch.randn(48).to(dtype)
    for qw in _formats(w):
        assert qlinear.q8_path_applies(qw, level)
        t = qlinear.tile(qw)
        for rows in (1, 3, 5, 6, 7, 9, 13, qlinear.SMALL_M):  # every pass size (8 rows at avx512, 6 at avx2)
            x = torch.randn(rows, 512)
            x[0, 32:96] = 0.0
            x = x.to(dtype)
            got = qlinear.kernel_matmul(x, t, bias, level=level)
            want = qlinear.reference_q8_matmul(x.float(), qw, bias.float())
            row_kernel = qlinear.kernel_matmul(x, qw, bias, level=level)
            if dtype == torch.float32:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
            else:
                torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=1e-2)
            torch.testing.assert_close(got.float(), row_kernel.float(), rtol=8e-3, atol=1e-3)


def test_tiling_applies_where_the_tiled_kernel_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    if not qlinear.available():
        missing("a C compiler for the CPU kernels", "install gcc or clang")
    qw = qlinear.quantize_int4(weight(48, 256), 32)
    assert qlinear.tile_applies(qw) == (qlinear.built_isa() in ("avx512", "avx2"))
    assert not qlinear.tile_applies(qlinear.quantize_int4(weight(40, 256), 32))  # 40 rows: no whole tiles
    assert not qlinear.tile_applies(qlinear.tile(qw))  # already tiled
    switches.use(switches.changed(qmatmul_activations="float"))
    # float activations have a tiled kernel too (kvpilot_qmatmul_tiled_float): the same layout
    assert qlinear.tile_applies(qw) == (qlinear.built_isa() in ("avx512", "avx2"))


def tiled_cases() -> list[tuple[str, qlinear.QuantizedWeight]]:
    """(level, weight) for the tiled float-activation kernels' tests: every level with the tiled layout
    (not generic: tile_applies), int4 groups of 32/64/128 (storage order interleaves a group's chunks
    above 32) and one group a row, int8 per channel and in groups."""
    weights = [
        qlinear.quantize_int4(weight(32, 512), 32),
        qlinear.quantize_int4(weight(48, 512), 64),
        qlinear.quantize_int4(weight(16, 512), 128),
        qlinear.quantize_int4(weight(16, 128), 128),
        qlinear.quantize_int8(weight(32, 512)),
        qlinear.quantize_int8(weight(32, 512), 32),
    ]
    levels = [lv for lv in isa.runnable() if lv != "generic"]
    for level in levels:
        if not qlinear.available(level):
            missing("a C compiler for the CPU kernels", "install gcc or clang")
    return [(level, qw) for level in levels for qw in weights]


@pytest.mark.usefixtures("exact_qmatmul")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_float_activations_give_the_exact_product(dtype: torch.dtype) -> None:
    """kvpilot_qmatmul_tiled_float at every level: x . dequant(W) in float32 (no activation rounding),
    for int4 groups of 32/64/128 (storage order interleaves a group's chunks above 32), int8 per
    channel and in groups, 1..17 rows (the row-count cases of the kernel, more than a pass of rows)."""
    torch.manual_seed(11)
    for level, qw in tiled_cases():
        t = qlinear.tile(qw)
        bias = torch.randn(qw.out_features)
        for m in (1, 2, 3, 5, 8, 9, 17):
            x = torch.randn(m, qw.in_features).to(dtype)
            got = qlinear.kernel_matmul(x, t, bias.to(dtype), level=level)
            exact = F.linear(x.double(), qw.dequantize(torch.float64), bias.to(dtype).double())
            if dtype == torch.float32:
                torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)
            else:  # the output rounded to bfloat16
                torch.testing.assert_close(got.double(), exact, rtol=8e-3, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_weights_take_every_path_of_matmul(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Many rows (the GEMM, or dequantize + torch) and float activations (the row kernel) untile on
    the fly; with AVX512-VNNI (and for int8 at avx2) the tiled kernel takes many rows itself."""
    if not qlinear.available():
        missing("a C compiler for the CPU kernels", "install gcc or clang")
    torch.manual_seed(5)
    qw = qlinear.quantize_int4(weight(48, 256), 64)
    t = qlinear.tile(qw)
    assert qlinear.max_kernel_rows(qw) == qlinear.SMALL_M
    vnni = qlinear.built_isa() == "avx512" and "avx512_vnni" in isa.cpu_features()
    assert qlinear.max_kernel_rows(t) == (qlinear.TILED_MAX_M if vnni else qlinear.SMALL_M)  # int4
    many = torch.randn(qlinear.max_kernel_rows(t) + 5, 256).to(dtype)
    torch.testing.assert_close(qlinear.matmul(many, t), qlinear.matmul(many, qw), rtol=0, atol=0)
    if vnni:
        some = torch.randn(300, 256).to(dtype)
        got, want = qlinear.matmul(some, t), qlinear.reference_q8_matmul(some.float(), qw)
        torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=1e-2)
    i8 = qlinear.tile(qlinear.quantize_int8(weight(48, 256)))
    avx2 = qlinear.built_isa() == "avx2"
    assert qlinear.max_kernel_rows(i8) == (qlinear.TILED_MAX_M if vnni or avx2 else qlinear.SMALL_M)
    switches.use(switches.changed(qmatmul_activations="float"))
    # float activations: the tiled float kernel up to TILED_FLOAT_MAX_M rows, then dequantize + torch;
    # both the exact product (the row layout's float kernel gives it too)
    assert qlinear.max_kernel_rows(t) == qlinear.TILED_FLOAT_MAX_M
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 1e-2}
    for rows in (2, qlinear.TILED_FLOAT_MAX_M + 3):
        x = torch.randn(rows, 256).to(dtype)
        torch.testing.assert_close(qlinear.matmul(x, t).float(), qlinear.matmul(x, qw).float(), **tol)


def test_routing_at_each_level_reads_the_isa_without_asking_the_library(
    cpu_isa: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """max_kernel_rows gives each level's row limits (tiled int4: AVX512-VNNI only; tiled int8: VNNI
    or avx2; row layout: SMALL_M) and matmul routes by them, without a ctypes call per matmul: the
    C code is asked its ISA once, when a level's library is loaded."""
    if not qlinear.available(cpu_isa):
        missing("a C compiler for the CPU kernels", "install gcc or clang")
    switches.use(switches.changed(qmatmul_activations="int8"))
    vnni = cpu_isa == "avx512" and "avx512_vnni" in isa.cpu_features()
    i4, i8 = qlinear.quantize_int4(weight(48, 256), 32), qlinear.quantize_int8(weight(48, 256))
    small, tiled = qlinear.SMALL_M, qlinear.TILED_MAX_M
    cases = [
        (i4, small),
        (i8, small),
        (qlinear.tile(i4), tiled if vnni else small),
        (qlinear.tile(i8), tiled if vnni or cpu_isa == "avx2" else small),
    ]
    assert qlinear.built_isa() == cpu_isa  # loads this level's library (asks the C code once)
    asked = qlinear.EXTENSION.isa_queries
    x = torch.randn(small + 1, 256)
    for _ in range(20):
        assert [qlinear.max_kernel_rows(qw) for qw, _ in cases] == [rows for _, rows in cases]
        for qw, rows in cases:
            assert qlinear.kernel_applies(x, qw) == (rows > small)
            assert qlinear.kernel_applies(x[:small], qw)
        qlinear.matmul(x[:2], i4)  # the C kernel at this level
    assert qlinear.EXTENSION.isa_queries == asked


def test_a_library_is_asked_its_isa_once_per_level() -> None:
    """A fresh extension (the built libraries, loaded again) asks each level's C code once."""
    ext = cbuild.Extension(qlinear.SOURCE, qlinear.CFLAGS, qlinear._declare, "test")
    levels = [lv for lv in isa.runnable() if ext.available(lv)]
    if not levels:
        missing("a C compiler for the CPU kernels", "install gcc or clang")
    assert ext.isa_queries == len(levels)  # available() loaded each
    for _ in range(3):
        assert [ext.built_isa(lv) for lv in levels] == levels
    assert ext.isa_queries == len(levels)


GEMM_LEVELS = [lv for lv in isa.runnable() if lv != "generic"]


@pytest.mark.parametrize("level", GEMM_LEVELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("rows", "k", "n"),
    # K = 512: two chunks of 8 blocks; 576: 8 + 8 + 2 (SmolLM2's width); 224: 4 + 2 + 1; 32: one
    # block. Rows and weight rows not multiples of the 4 x 2 register tile, N not of the 16-row panel.
    [(33, 512, 96), (40, 576, 37), (7, 224, 50), (64, 32, 17), (300, 64, 20)],  # 300: 3 row blocks
)
def test_gemm_matches_the_specification(level: str, dtype: torch.dtype, rows: int, k: int, n: int) -> None:
    """The many-row int8-activation GEMM (qgemm_cpu.c) at every level it is built for, every weight
    format and every chunk size of its layout, against `reference_q8_matmul` (and near the float
    product); the small-M kernel gives the same numbers for the same rows."""
    if not qlinear.GEMM_EXTENSION.available(level):
        missing("a C compiler for the CPU kernels", "install gcc or clang")
    assert qlinear.GEMM_EXTENSION.built_isa(level) == level
    torch.manual_seed(rows + k)
    w = torch.randn(n, k) * 0.05
    w[3] = 0.0  # an all-zero row
    x = torch.randn(rows, k)
    x[0, :32] = 0.0  # a zero block: scale 0, codes 0
    x[1, 5] = 60.0  # an outlier sets its block's scale
    x = x.to(dtype)
    bias = torch.randn(n).to(dtype)
    formats = [qlinear.quantize_int8(w)] + ([qlinear.quantize_int8(w, 32)] if k % 32 == 0 else [])
    formats += [qlinear.quantize_int4(w, g) for g in qlinear.INT4_GROUPS if k % g == 0]
    for qw in formats:
        got = qlinear.gemm_matmul(x, qw, bias, level=level)
        assert got.dtype == dtype and got.shape == (rows, n)
        want = qlinear.reference_q8_matmul(x.float(), qw, bias.float())
        exact = F.linear(x.float(), qw.dequantize(torch.float32), bias.float())
        assert (want - exact).norm() / exact.norm() < 0.02  # the outlier block rounds coarsely
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
            small = qlinear.kernel_matmul(x[:4], qw, bias, level=level)
            torch.testing.assert_close(got[:4], small, rtol=1e-5, atol=1e-5)
        else:
            torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=1e-2)


def test_gemm_takes_the_many_row_matmuls_and_refuses_what_it_cannot_do() -> None:
    """`matmul` routes more than SMALL_M rows to the GEMM where the level has it for the format;
    the generic level and widths that are not a multiple of 32 are refused with a clear error."""
    level = isa.selected()
    qw = qlinear.quantize_int4(weight(), 32)
    big = torch.randn(qlinear.SMALL_M + 5, 256)
    if level != "generic" and qlinear.GEMM_EXTENSION.available(level):
        first = qlinear.GEMM_MIN_ROWS[level][4]
        assert qlinear.gemm_applies(big, qw) and qlinear.gemm_applies(big[:first], qw)
        assert not qlinear.gemm_applies(big[: first - 1], qw)  # the small-M kernel's rows
        assert qlinear.kernel_applies(big[: first - 1], qw)
        # a wide input (a large model's down projection): 64 chunks of 8 blocks
        wide_qw, wide_x = qlinear.quantize_int4(torch.randn(3, 16384), 32), torch.randn(9, 16384)
        assert qlinear.gemm_applies(wide_x, wide_qw)
        torch.testing.assert_close(
            qlinear.gemm_matmul(wide_x, wide_qw),
            qlinear.reference_q8_matmul(wide_x, wide_qw),
            rtol=1e-5,
            atol=1e-3,
        )
        torch.testing.assert_close(
            qlinear.matmul(big, qw), qlinear.reference_q8_matmul(big, qw), rtol=1e-5, atol=1e-4
        )
    if "generic" in isa.runnable() and qlinear.GEMM_EXTENSION.available("generic"):
        assert not qlinear.gemm_applies(big, qw, level="generic")
        with pytest.raises(ValueError, match="does not apply here"):
            qlinear.gemm_matmul(big, qw, level="generic")
    wide = qlinear.quantize_int8(torch.randn(1, qlinear.GEMM_MAX_K + 32))  # beyond the chunk table
    assert not qlinear.gemm_applies(torch.randn(40, qlinear.GEMM_MAX_K + 32), wide)
    odd = qlinear.quantize_int8(torch.randn(8, 40))
    assert not qlinear.gemm_applies(torch.randn(40, 40), odd)
    with pytest.raises(ValueError, match="input has 39 features"):
        qlinear.gemm_matmul(torch.randn(40, 39), odd)


@pytest.mark.usefixtures("exact_qmatmul")
def test_float_activations_keep_many_rows_on_the_exact_product() -> None:
    """KVPILOT_QMATMUL_ACTIVATIONS=float: no GEMM with int8 activations, the dequantized product."""
    qw = qlinear.quantize_int4(weight(), 32)
    big = torch.randn(qlinear.SMALL_M + 5, 256)
    assert not qlinear.gemm_applies(big, qw)
    torch.testing.assert_close(
        qlinear.matmul(big, qw), qlinear.reference_matmul(big, qw), rtol=1e-5, atol=1e-5
    )


@pytest.fixture
def bf16_qmatmul() -> None:
    """--qmatmul-activations bf16 (restored by conftest's kernel_switches_restored)."""
    switches.use(switches.changed(qmatmul_activations="bf16"))


def bf16_spec(x: torch.Tensor, qw: qlinear.QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """What `--qmatmul-activations bf16` computes: x rounded to bfloat16 . dequant(W), exact sums."""
    b = None if bias is None else bias.double()
    return F.linear(x.to(torch.bfloat16).double(), qw.dequantize(torch.float64), b)


@pytest.mark.usefixtures("bf16_qmatmul")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_bf16_activations_give_the_rounded_activations_exact_product(dtype: torch.dtype) -> None:
    """kvpilot_qmatmul_tiled_bf16 at every level (int4 and int8 with AVX512-BF16: vdpbf16ps on code
    pairs; elsewhere the float kernel on rounded activations): x_bf16 . dequant(W) in float32, for the
    float kernel's cases. Against the unrounded product it is further off than float32's sums are, so
    the rounding is there: the flag does what it says."""
    torch.manual_seed(12)
    for level, qw in tiled_cases():
        t = qlinear.tile(qw)
        bias = torch.randn(qw.out_features).to(dtype)
        for m in (1, 2, 3, 5, 8, 9, 16, 17, 45):  # 45: passes of 16, 16, 8 and 5 rows
            x = (torch.randn(m, qw.in_features) * 4 + 1).to(dtype)  # an offset: sum(x) matters
            got = qlinear.kernel_matmul(x, t, bias, level=level).double()
            want = bf16_spec(x, qw, bias)
            if dtype == torch.float32:  # each code exact: no offset to cancel (1e-4 with 128 + code)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)
                unrounded = F.linear(x.double(), qw.dequantize(torch.float64), bias.double())
                assert (got - unrounded).abs().max() > 10 * (got - want).abs().max(), (level, qw.bits, m)
            else:  # the output rounded to bfloat16
                torch.testing.assert_close(got, want, rtol=8e-3, atol=2e-2)


@pytest.mark.parametrize("mode", ["int16", "bf16", "float"])
def test_a_long_call_runs_in_row_blocks_that_change_no_sum(mode: str) -> None:
    """A call of many rows at a wide K runs in blocks of rows (M_BLOCK_BYTES: 48 rows at K = 8,192),
    every tile per block, and its setup on the call's threads: each row's output is bit-identical
    to a call on its own block (passes fall as they would), and right (x_bf16 . dequant(W))."""
    torch.manual_seed(14)
    k, rows = 8192, 48 * 2 + 7  # three blocks at either width of activations (bf16 pairs, float)
    for level, qw in [(lv, q) for lv, q in tiled_cases() if q.in_features == 512][::3]:
        big = (
            qlinear.quantize_int4(weight(32, k), 32)
            if qw.bits == 4
            else qlinear.quantize_int8(weight(32, k), 32)
        )
        t = qlinear.tile(big)
        x = torch.randn(rows, k) * 4 + 1
        with switches.using(qmatmul_activations=mode):
            whole = qlinear.kernel_matmul(x, t, level=level)
            parts = torch.cat(
                [qlinear.kernel_matmul(x[i : i + 48], t, level=level) for i in range(0, rows, 48)]
            )
        assert torch.equal(whole, parts), (level, big.bits, mode)
        if mode == "float":
            want = F.linear(x.double(), big.dequantize(torch.float64))
        else:
            want = (bf16_spec if mode == "bf16" else i16_spec)(x, big, None)
        torch.testing.assert_close(whole.double(), want, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("mode", ["int8", "int16", "bf16", "float"])
def test_the_tiled_kernels_sums_do_not_depend_on_the_thread_count(mode: str) -> None:
    """Each tile is one thread's whole work (no sum is split between threads), so every output is
    bit-identical at any thread count, more threads than cores and tile counts that do not divide
    evenly included: a scheduling change cannot change an answer."""
    if not qlinear.available():
        missing("a C compiler for the CPU kernels", "install gcc or clang")
    torch.manual_seed(15)
    qws = [qlinear.quantize_int4(weight(16 * 37, 512), 32), qlinear.quantize_int8(weight(16 * 37, 512), 32)]
    before = torch.get_num_threads()
    try:
        with switches.using(qmatmul_activations=mode):
            for qw in qws:
                t = qlinear.tile(qw)
                for rows in (1, 7, 16, 53):
                    x = torch.randn(rows, 512) * 4 + 1
                    torch.set_num_threads(1)
                    one = qlinear.kernel_matmul(x, t)
                    for n in (2, 3, 7):
                        torch.set_num_threads(n)
                        assert torch.equal(qlinear.kernel_matmul(x, t), one), (mode, qw.bits, rows, n)
    finally:
        torch.set_num_threads(before)


@pytest.mark.usefixtures("bf16_qmatmul")
def test_bf16_activations_on_every_path_of_matmul() -> None:
    """Under bf16 every route rounds the activations: the tiled kernel up to max_kernel_rows (every
    row count with vdpbf16ps, TILED_FLOAT_MAX_M on the float kernel), then dequantize + torch; the
    row layout's kernel; no int8-activation GEMM."""
    if not qlinear.available():
        missing("a C compiler for the CPU kernels", "install gcc or clang")
    torch.manual_seed(13)
    qw = qlinear.quantize_int4(weight(48, 256), 64)
    t = qlinear.tile(qw)
    vdp = qlinear.built_isa() == "avx512" and isa.bf16_dot()
    assert qlinear.bf16_tiles(t) == vdp
    assert qlinear.max_kernel_rows(t) == (qlinear.TILED_BF16_MAX_M if vdp else qlinear.TILED_FLOAT_MAX_M)
    for rows in (2, qlinear.SMALL_M + 3, qlinear.TILED_FLOAT_MAX_M + 3):
        x = torch.randn(rows, 256) * 4
        assert not qlinear.gemm_applies(x, qw)
        for w in (t, qw):
            got = qlinear.matmul(x, w).double()
            torch.testing.assert_close(got, bf16_spec(x, qw, None), rtol=1e-5, atol=2e-5)
    i8 = qlinear.tile(qlinear.quantize_int8(weight(48, 256)))
    assert qlinear.bf16_tiles(i8) == vdp  # int8 codes are exact in bfloat16 too
    assert qlinear.max_kernel_rows(i8) == (qlinear.TILED_BF16_MAX_M if vdp else qlinear.TILED_FLOAT_MAX_M)
    for rows in (2, qlinear.TILED_FLOAT_MAX_M + 3):
        x = torch.randn(rows, 256) * 4
        got = qlinear.matmul(x, i8).double()
        torch.testing.assert_close(got, bf16_spec(x, i8, None), rtol=1e-5, atol=2e-5)


def i16_spec(x: torch.Tensor, qw: qlinear.QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """What `--qmatmul-activations int16` computes: x rounded to int16 per block of 32 of the weight's
    storage order (qlinear.round_i16) . dequant(W), exact sums."""
    b = None if bias is None else bias.double()
    return F.linear(qlinear.reference_round_i16(x.float(), qw).double(), qw.dequantize(torch.float64), b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int16_rounding_in_c_is_the_reference_rounding(dtype: torch.dtype) -> None:
    """kvpilot_round_i16 (one pass in C: what the routes other than the tiled kernel multiply under
    int16) gives reference_round_i16's activations for every storage order (int4 groups of 32/64/128,
    int8), to float32's last bit (its scale divisions may take a reciprocal), at 1 and many threads."""
    if not qlinear.available():
        missing("a C compiler for the CPU kernels", "install gcc or clang")
    torch.manual_seed(19)
    before = torch.get_num_threads()
    try:
        for qw in (
            qlinear.quantize_int4(weight(16, 512), 32),
            qlinear.quantize_int4(weight(16, 512), 64),
            qlinear.quantize_int4(weight(16, 512), 128),
            qlinear.quantize_int8(weight(16, 512)),
        ):
            x = (torch.randn(300, 512) * 4 + 1).to(dtype)
            x[3] = 0.0
            for threads in (1, 3):
                torch.set_num_threads(threads)
                got = qlinear.round_i16(x, qw)
                want = qlinear.reference_round_i16(x, qw)
                assert got.dtype == dtype and bool((got[3] == 0).all())
                tol = {"rtol": 3e-7, "atol": 0.0} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 0.0}
                torch.testing.assert_close(got, want, **tol)
    finally:
        torch.set_num_threads(before)


def test_int16_rounding_is_per_block_of_the_storage_order() -> None:
    """round_i16: each 32-block of the storage order keeps its largest magnitude exactly and every
    element within half a step (max / 32767 / 2) of itself; a block of zeros stays zero; a K that is not
    a multiple of 32 rounds its last, shorter block too."""
    torch.manual_seed(16)
    qw = qlinear.quantize_int4(weight(16, 256), 128)  # chunks interleave a group's halves
    x = torch.randn(3, 256) * 5
    x[1, :] = 0.0
    got = qlinear.reference_round_i16(x, qw)
    blocks = x[:, qlinear.storage_order(qw)].reshape(3, -1, 32)
    step = blocks.abs().amax(-1, keepdim=True) / qlinear.I16_MAX
    err = (got[:, qlinear.storage_order(qw)].reshape(3, -1, 32) - blocks).abs()
    assert bool((err <= step * 0.501).all())  # half a step, and float32's rounding of x * 32767 / max
    assert bool((got[1] == 0).all())
    assert (got - x).abs().max() > 0  # rounded: not the activations as given
    odd = qlinear.quantize_int8(weight(8, 40))
    y = torch.randn(2, 40)
    tail = y[:, 32:].abs().amax(-1, keepdim=True) / qlinear.I16_MAX
    assert bool(((qlinear.round_i16(y, odd)[:, 32:] - y[:, 32:]).abs() <= tail * 0.501).all())  # torch form


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_int16_activations_give_the_rounded_activations_exact_product(dtype: torch.dtype) -> None:
    """kvpilot_qmatmul_tiled_i16 at every level with the tiled layout (vpmaddwd on codes widened to
    int16): round_i16(x) . dequant(W), for the float kernel's cases and row counts across passes. It is
    closer to the unrounded product than int8 activations are by orders of magnitude, and further than
    float32's sums: the rounding is there, and it is the 16-bit one."""
    torch.manual_seed(17)
    with switches.using(qmatmul_activations="int16"):
        for level, qw in tiled_cases():
            t = qlinear.tile(qw)
            bias = torch.randn(qw.out_features).to(dtype)
            for m in (1, 2, 3, 5, 6, 7, 8, 9, 17, 45):
                x = (torch.randn(m, qw.in_features) * 4 + 1).to(dtype)
                got = qlinear.kernel_matmul(x, t, bias, level=level).double()
                want = i16_spec(x, qw, bias)
                if dtype == torch.float32:
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)
                    exact = F.linear(x.double(), qw.dequantize(torch.float64), bias.double())
                    int8 = qlinear.reference_q8_matmul(x.float(), qw, bias.float()).double()
                    assert (got - exact).abs().max() < (int8 - exact).abs().max() / 50, (level, qw.bits, m)
                else:  # the output rounded to bfloat16
                    torch.testing.assert_close(got, want, rtol=8e-3, atol=2e-2)


def i16_extreme_rows(m: int, k: int) -> torch.Tensor:
    """m rows of k activations whose 32-blocks round to int16's extremes: all +max (code 32767: high
    byte 127, low byte 255), all -max (-32767: -128 and 1), one +max among -max / 32767 (-1: -1 and
    255), or random; a pattern and a magnitude per row and block."""
    x = torch.randn(m, k)
    blocks = x.view(m, k // 32, 32)
    for r in range(m):
        for b in range(k // 32):
            a = float(torch.rand(()) * 9 + 0.5)
            kind = (r + b) % 4
            if kind == 0:
                blocks[r, b] = a
            elif kind == 1:
                blocks[r, b] = -a
            elif kind == 2:
                blocks[r, b] = -a / 32767
                blocks[r, b, (r + 5 * b) % 32] = a
    return x


@pytest.mark.parametrize("group", [32, 128])
def test_tiled_int16_int4_rows_split_into_bytes_are_exact(group: int) -> None:
    """kvpilot_qmatmul_tiled_i16 on int4 up to I16_SPLIT_MAX_M rows multiplies the codes by each
    activation's high and low bytes (maddubs, 256 hi + lo); more rows widen the codes to int16. At the
    sums' limits (all-15 codes against blocks rounded to +-32767 and -1: the low bytes' 16-bit sums
    past 32767, the high bytes' at -30720) each row of 1..5 is bit-identical to the same row in a call
    of 7 rows (the widened path) and to i16_spec."""
    if not qlinear.available():
        missing("a C compiler for the CPU kernels", "install gcc or clang")
    torch.manual_seed(20)
    k = 512
    qw = qlinear.quantize_int4(torch.randn(32, k) * 0.05, group)
    per_group = qw.packed.view(32, k // group, group // 2)
    per_group[:, ::2] = 0xFF  # every other group all codes 15: the low bytes' sums at 61200
    per_group[1] = 0xFF  # and a whole row of them
    t = qlinear.tile(qw)
    x = i16_extreme_rows(7, k)
    with switches.using(qmatmul_activations="int16"):
        for level in [lv for lv in isa.runnable() if lv != "generic"]:
            widened = qlinear.kernel_matmul(x, t, level=level)
            want = i16_spec(x, qw, None)
            scale = F.linear(x.abs().double(), qw.dequantize(torch.float64).abs())
            assert bool(((widened.double() - want).abs() <= 1e-6 * scale + 1e-6).all()), level
            for m in range(1, 6):
                for r0 in (0, 7 - m):
                    split = qlinear.kernel_matmul(x[r0 : r0 + m], t, level=level)
                    assert torch.equal(split, widened[r0 : r0 + m]), (level, group, m, r0)


def test_int16_activations_on_every_path_of_matmul() -> None:
    """Under int16 every route multiplies the same rounded activations: the tiled kernel up to
    TILED_I16_MAX_M rows at avx512 (its 512-bit kernel), TILED_FLOAT_MAX_M at avx2, then dequantize +
    torch; the row layout's float kernel; no int8 GEMM."""
    if not qlinear.available():
        missing("a C compiler for the CPU kernels", "install gcc or clang")
    torch.manual_seed(18)
    wide = qlinear.built_isa() == "avx512"
    limit = qlinear.TILED_I16_MAX_M if wide else qlinear.TILED_FLOAT_MAX_M
    with switches.using(qmatmul_activations="int16"):
        for qw in (qlinear.quantize_int4(weight(48, 256), 64), qlinear.quantize_int8(weight(48, 256))):
            t = qlinear.tile(qw)
            assert qlinear.max_kernel_rows(t) == limit
            for rows in sorted({2, qlinear.SMALL_M + 3, qlinear.TILED_FLOAT_MAX_M + 3, limit + 3}):
                x = torch.randn(rows, 256) * 4
                assert not qlinear.gemm_applies(x, qw)
                for w in (t, qw):
                    got = qlinear.matmul(x, w).double()
                    torch.testing.assert_close(got, i16_spec(x, qw, None), rtol=1e-5, atol=2e-5)
