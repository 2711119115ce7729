"""Quantized experts (`--quantization int8|int4` on a Mixture-of-Experts model).

- `moe_grouped` with one QuantizedWeight per expert against `moe_reference` on the dequantized
  stacks: float32 and bfloat16, few rows per expert (qlinear's C kernel) and many (dequantize +
  torch), whole and split between expert-parallel "ranks". These plumbing checks run the kernel with
  float activations (the `exact_qmatmul` fixture); with its default int8 activations the result is
  within the activation rounding of the reference (tested here, and the kernel against its
  specification in tests/kernels/test_qlinear.py).
- `quantize_model` on the tiny random-weight families (tests/runtime/test_moe.py): every MoE layer's
  experts quantized and the 16/32-bit stacks freed; logits through prefill + paged decode equal to a
  float32 model holding the dequantized weights; the deficit against the unquantized model measured
  as the dense path's tests measure it (max |logit diff| / max |logit|), int8's greedy first token kept.
- Under tensor parallelism (each rank quantizes its half of every expert) and expert parallelism
  (whole experts per rank): the same greedy tokens and logits as tp=1 with int8 experts.
- A width that cannot take the int4 group is refused naming the flag, before anything changes.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvpilot.kernels import isa, qlinear, switches
from kvpilot.runtime.config import ConfigError, EngineConfig
from kvpilot.runtime.engine.core import LLMEngine
from kvpilot.runtime.engine.tp.runner import TPModelRunner
from kvpilot.runtime.load.loader import LoadedModel, load_model
from kvpilot.runtime.load.quantization import expert_layers, linear_layers, quantize_model, tile_for_cpu
from kvpilot.runtime.models.moe import FusedMoE, dequantize_experts, moe_grouped, moe_reference, route
from tests.needs import missing
from tests.runtime.test_model_parity import PagedKV, rel_diff
from tests.runtime.test_moe import FAMILIES, TINY_VOCAB, make_tiny_moe_dir
from tests.runtime.test_tensor_parallel import engine_config, run, start, tiny_prompts  # noqa: F401

METHODS = [("int8", 0), ("int4", 32)]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _random_moe(t: int, e: int, k: int, h: int = 64, i: int = 32, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, i, generator=g) / i**0.5
    weights, ids = route(torch.randn(t, e, generator=g), k, renormalize=True)
    return x, w13, w2, weights, ids


def _quantize(w: torch.Tensor, method: str, group: int) -> list[qlinear.QuantizedWeight]:
    return [qlinear.quantize(w[e], method, group) for e in range(w.shape[0])]


@pytest.mark.parametrize(("method", "group"), METHODS)
@pytest.mark.parametrize(
    ("t", "e", "k"),
    [(1, 8, 2), (7, 8, 2), (32, 16, 4), (100, 4, 2)],  # last: ~50 rows per expert, above SMALL_M
)
def test_quantized_grouped_matches_dequantized_reference(
    method: str, group: int, t: int, e: int, k: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    x, w13, w2, weights, ids = _random_moe(t, e, k, seed=t)
    q13, q2 = _quantize(w13, method, group), _quantize(w2, method, group)
    ref = moe_reference(x, dequantize_experts(q13), dequantize_experts(q2), weights, ids)
    q8 = moe_grouped(x, q13, q2, weights, ids)  # int8 activations where the kernel runs
    assert float((q8 - ref).norm() / ref.norm()) < 0.02
    switches.use(switches.changed(qmatmul_activations="float"))
    got = moe_grouped(x, q13, q2, weights, ids)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # the quantized weights are not the float ones: the comparison above could fail
    assert float((moe_reference(x, w13, w2, weights, ids) - ref).abs().max()) > 1e-4


def test_few_rows_take_the_c_kernel() -> None:
    """A decode step's rows per expert (up to SMALL_M) go to qlinear's C kernel, which reads the
    quantized bytes; the test above then compared the kernel, not the dequantizing fallback."""
    if not qlinear.available():
        missing("qlinear's C kernel", "it did not build here: install a C compiler (cc)")
    _, w13, _, _, _ = _random_moe(1, 2, 1)
    assert qlinear.kernel_applies(torch.zeros(qlinear.SMALL_M, 64), qlinear.quantize(w13[0], "int8", 0))


@pytest.mark.parametrize(("method", "group"), METHODS)
@pytest.mark.usefixtures("exact_qmatmul")
def test_quantized_bfloat16_close_to_float32(method: str, group: int) -> None:
    x, w13, w2, weights, ids = _random_moe(24, 8, 2, seed=11)
    q13, q2 = _quantize(w13, method, group), _quantize(w2, method, group)
    ref = moe_reference(x.bfloat16().float(), dequantize_experts(q13), dequantize_experts(q2), weights, ids)
    got = moe_grouped(x.bfloat16(), q13, q2, weights, ids).float()
    assert float((got - ref).abs().max() / ref.abs().max()) < 2e-2


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.usefixtures("exact_qmatmul")
def test_quantized_expert_shards_sum_to_whole(ranks: int) -> None:
    x, w13, w2, weights, ids = _random_moe(40, 8, 2, seed=5)
    q13, q2 = _quantize(w13, "int4", 32), _quantize(w2, "int4", 32)
    whole = moe_reference(x, dequantize_experts(q13), dequantize_experts(q2), weights, ids)
    per = 8 // ranks
    parts = [
        moe_grouped(x, q13[r * per : (r + 1) * per], q2[r * per : (r + 1) * per], weights, ids, r * per)
        for r in range(ranks)
    ]
    torch.testing.assert_close(sum(parts), whole, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Whole tiny models


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    dirs = {}
    for family in FAMILIES:
        dirs[family] = tmp_path_factory.mktemp(family)
        make_tiny_moe_dir(family, dirs[family])
    return dirs


def _load(directory: Path) -> LoadedModel:
    return load_model(EngineConfig(model=str(directory)), torch.device("cpu"), torch.float32)


def _logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    """A prefill of all but 4 tokens (many rows per expert) then 4 decode steps (one row each)."""
    kv = PagedKV(loaded.arch, num_blocks=16, block_size=8, seed=1)
    rows = [kv.logits(loaded.model, [(0, ids[:-4])])]
    rows += [kv.logits(loaded.model, [(0, [t])]) for t in ids[-4:]]
    return torch.cat(rows)


# max |logit diff| / max |logit| against the float32 model, measured on these tiny random models
# (weights ~ N(0, 0.2)): int8 per channel 0.007-0.053, int4 group 32 0.11-0.15
DEFICIT_BOUND = {"int8": 0.1, "int4": 0.4}


# the tiny Qwen2-MoE's shared expert is 48 wide: no int4 group fits it (refused: the test below)
MODEL_CASES = [(f, m, g) for f in FAMILIES for m, g in METHODS if (f, m) != ("qwen2moe", "int4")]


@pytest.mark.parametrize(("family", "method", "group"), MODEL_CASES)
@pytest.mark.usefixtures("exact_qmatmul")
def test_quantized_model_equals_its_dequantized_weights(
    tiny_dirs: dict[str, Path], family: str, method: str, group: int
) -> None:
    full, quant, deq = _load(tiny_dirs[family]), _load(tiny_dirs[family]), _load(tiny_dirs[family])
    report = quantize_model(quant.model, method, group)
    moe = list(expert_layers(quant.model))
    assert report.expert_layers == len(moe) == (1 if family == "qwen2moe" else 2)  # qwen2moe: a dense layer
    for _, experts in moe:
        assert experts.w13 is None and experts.w2 is None  # the float stacks are freed
        assert experts.q13 is not None and experts.q2 is not None
        assert {q.bits for q in experts.q13 + experts.q2} == {int(method[3:])}
    assert report.bytes_after < report.bytes_before / (
        3.5 if method == "int8" else 5.0
    )  # float32 -> ~1 or 5/8 bytes
    # the reference: float32 layers holding exactly the dequantized weights
    for (_, q), (_, d) in zip(linear_layers(quant.model), linear_layers(deq.model), strict=True):
        assert q.qweight is not None and d.weight is not None
        d.weight.data = q.qweight.dequantize(torch.float32)
    for (_, q), (_, d) in zip(expert_layers(quant.model), expert_layers(deq.model), strict=True):
        assert q.q13 is not None and q.q2 is not None
        d.w13.data, d.w2.data = dequantize_experts(q.q13), dequantize_experts(q.q2)
    ids = torch.randint(3, TINY_VOCAB, (24,), generator=torch.Generator().manual_seed(8)).tolist()
    got, ref, want = _logits(quant, ids), _logits(deq, ids), _logits(full, ids)
    _, rel = rel_diff(got, ref)
    assert rel < 1e-4, rel
    _, deficit = rel_diff(got, want)
    print(f"\ntiny {family} {method}: max |logit diff| / max |logit| vs float32 = {deficit:.4f}")
    assert 0 < deficit < DEFICIT_BOUND[method]
    if method == "int8":  # int4's ~15% moves near-tied argmaxes of these random-weight models
        assert int(got[-5].argmax()) == int(want[-5].argmax())  # the prompt's next token


def test_an_expert_width_that_cannot_take_the_group_is_refused(tiny_dirs: dict[str, Path]) -> None:
    loaded = _load(tiny_dirs["mixtral"])  # hidden 64 (every linear's input), expert width 32
    with pytest.raises(
        ConfigError,
        match=r"--quantization int4: experts model.layers.0.mlp.experts: in_features 32 is not a "
        r"multiple of the int4 group size 64; --quantization-group-size 32 fits every layer",
    ):
        quantize_model(loaded.model, "int4", 64)
    experts = [m for m in loaded.model.modules() if isinstance(m, FusedMoE)]
    assert all(m.q13 is None and m.w13 is not None for m in experts)  # nothing changed
    assert all(m.weight is not None for _, m in linear_layers(loaded.model))
    quantize_model(loaded.model, "int8", 0)
    with pytest.raises(ValueError, match="already quantized") as exc:
        quantize_model(loaded.model, "int8", 0)
    assert not isinstance(exc.value, ConfigError)  # no flag makes this call: a programming error
    qwen = tiny_dirs["qwen2moe"]
    # through the loader, as `kvpilot serve --quantization int4` gets it: a ConfigError (one line, exit 2)
    with pytest.raises(
        ConfigError,
        match=r"--quantization int4: layer .*shared_expert.down_proj: in_features 48 .*"
        r"--quantization int8 \(per output channel\) takes any width",
    ):
        load_model(EngineConfig(model=str(qwen), quantization="int4"), torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("ep", [False, True])
def test_quantized_experts_under_tensor_and_expert_parallelism(
    tiny_dirs: dict[str, Path],
    ep: bool,
    start: Callable[..., LLMEngine],  # noqa: F811
) -> None:
    """Each rank quantizes what it holds: whole experts (EP) or half of each expert's width (tp). The
    row-parallel linears (o_proj; tp: the experts' w2) then have per-channel scales over half of the
    columns, and a shard sums in another float order (and, too narrow for 16-row tiles, in the row
    layout where tp=1 runs tiled), which can flip an int8 activation code downstream: the logits are
    close to tp=1's (within int8's own error: 4.8% on SmolLM2), not equal."""
    settings = {"block_size": 8, "max_num_batched_tokens": 32, "quantization": "int8"}
    one = start(engine_config(str(tiny_dirs["mixtral"]), 1, **settings))
    assert one.runner.model.model.layers[0].mlp.experts.q13 is not None
    ref = run(one, tiny_prompts(), max_tokens=8)
    one.runner.close()
    two = start(engine_config(str(tiny_dirs["mixtral"]), 2, enable_expert_parallel=ep, **settings))
    assert isinstance(two.runner, TPModelRunner)
    experts = two.runner.shard.model.layers[0].mlp.experts
    assert experts.q13 is not None and experts.w13 is None
    ours = run(two, tiny_prompts(), max_tokens=8)
    two.runner.close()
    worst = 0.0
    for a, b in zip(ours, ref, strict=True):
        assert a.tokens[0] == b.tokens[0]
        same = next(
            (j for j, (x, y) in enumerate(zip(a.tokens, b.tokens, strict=True)) if x != y), len(a.tokens)
        )
        for mine, theirs in zip(a.logits[: same + 1], b.logits[: same + 1], strict=True):
            worst = max(worst, float((mine - theirs).abs().max() / theirs.abs().max()))
    assert 0 < worst < 0.1  # measured 0.027 (EP) and 0.07 (tp)
    print(f"\nint8 experts, tp=2{' EP' if ep else ''}: worst logit difference vs tp=1 {worst:.2g}")


@pytest.mark.parametrize(("method", "group"), [*METHODS, ("int4", 64)])
@pytest.mark.parametrize(("t", "e", "k"), [(1, 8, 2), (7, 8, 2), (32, 16, 4)])
def test_fused_experts_is_the_per_expert_loop_in_one_call(
    method: str, group: int, t: int, e: int, k: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """qlinear.fused_experts (one C call for the layer: each token quantized once, each active
    expert's rows read once, float32 intermediates) computes what moe_grouped's loop of per-expert
    small-M kernel calls computes, whole and split between expert-parallel ranks. (The loop's
    experts with GEMM_MIN_ROWS rows or more would take the GEMM: the same arithmetic up to float
    rounding, which can flip the rounding of an intermediate activation and move an output by a
    quantization step, so the loop is pinned to the small-M kernel here.)"""
    if not qlinear.available() or qlinear.built_isa() not in ("avx512", "avx2"):
        missing("qlinear's C kernel at the avx512 or avx2 level", "a C compiler and an x86-64 CPU with AVX2")
    monkeypatch.setattr(qlinear, "GEMM_MIN_ROWS", {})
    x, w13, w2, weights, ids = _random_moe(t, e, k, h=128, i=64, seed=t)
    q13, q2 = _quantize(w13, method, group or 32), _quantize(w2, method, group or 32)
    table = qlinear.expert_table(q13, q2)
    assert table is not None
    got = qlinear.fused_experts(x, table, weights, ids)
    assert got is not None
    torch.testing.assert_close(got, moe_grouped(x, q13, q2, weights, ids), rtol=1e-4, atol=1e-5)
    half = e // 2
    parts = [
        qlinear.fused_experts(x, qlinear.expert_table(q13[a:b], q2[a:b]), weights, ids, a)  # type: ignore[arg-type]
        for a, b in ((0, half), (half, e))
    ]
    torch.testing.assert_close(parts[0] + parts[1], got, rtol=1e-5, atol=1e-6)  # type: ignore[operator]
    bf16 = qlinear.fused_experts(x.bfloat16(), table, weights, ids)
    assert bf16 is not None and bf16.dtype == torch.bfloat16
    assert float((bf16.float() - got).norm() / got.norm()) < 0.02
    # the tiled layout (what a loaded CPU model holds): the same arithmetic, 16 rows at a time
    t13, t2 = [qlinear.tile(q) for q in q13], [qlinear.tile(q) for q in q2]
    tiled = qlinear.expert_table(t13, t2)
    assert tiled is not None and tiled.tiled and qlinear.expert_table(t13, q2) is None  # one layout a call
    on_tiles = qlinear.fused_experts(x, tiled, weights, ids)
    assert on_tiles is not None
    # pass 1's float sums come out in another order (a block's integer sum converted once, not per
    # lane), so an intermediate activation can round to the neighbouring int8 code before pass 2:
    # a few elements move by one code's worth, the rest agree to float rounding
    close = torch.isclose(on_tiles, got, rtol=1e-4, atol=1e-5)
    assert float(close.float().mean()) > 0.9
    assert float((on_tiles - got).norm() / got.norm()) < 1e-2


def test_fused_experts_declines_where_the_loop_is_faster_or_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    x, w13, w2, weights, ids = _random_moe(8, 4, 2, h=64, i=32)
    q13, q2 = _quantize(w13, "int8", 0), _quantize(w2, "int8", 0)
    table = qlinear.expert_table(q13, q2)
    assert table is not None
    many = torch.randn(qlinear.SMALL_M * 4 // 2 + 1, 64)  # more rows per expert than SMALL_M on average
    mw, mi = route(torch.randn(many.shape[0], 4), 2, renormalize=True)
    assert qlinear.fused_experts(many, table, mw, mi) is None
    # tiled experts where the kernel has AVX512-VNNI take prefill-sized batches too
    t13, t2 = [qlinear.tile(q) for q in q13], [qlinear.tile(q) for q in q2]
    tiled = qlinear.expert_table(t13, t2)
    assert tiled is not None
    prefill = qlinear.fused_experts(many, tiled, mw, mi)
    if qlinear.max_kernel_rows(t13[0]) > qlinear.SMALL_M:
        assert prefill is not None
        want = moe_grouped(many, q13, q2, mw, mi)  # many rows: dequantized weights, exact products
        # int8 activations in both passes against the exact float product (~1% measured)
        assert float((prefill - want).norm() / want.norm()) < 3e-2
    else:
        assert prefill is None
    assert qlinear.expert_table(q13, _quantize(w2, "int4", 32)) is None  # mixed formats
    switches.use(switches.changed(qmatmul_activations="float"))
    assert qlinear.fused_experts(x, table, weights, ids) is None  # exact products: the loop's kernel calls


@pytest.mark.parametrize("family", ["mixtral", "olmoe"])
def test_quantized_moe_layer_takes_the_fused_call(tiny_dirs: dict[str, Path], family: str) -> None:
    if not qlinear.available():
        missing("a C compiler for the CPU kernels", "install gcc or clang")
    if qlinear.built_isa() not in ("avx512", "avx2"):  # hardware (tests/needs.py's policy)
        pytest.skip(
            "the fused quantized expert call needs the avx512 or avx2 kernels: the generic sibling below"
        )
    loaded = _load(tiny_dirs[family])
    quantize_model(loaded.model, "int8", 32)
    (_, experts), *_ = list(expert_layers(loaded.model))
    x = torch.randn(3, experts.hidden_size)
    weights, ids = route(torch.randn(3, experts.num_experts), 2, renormalize=True)
    table = experts.expert_table()
    assert table is not None and experts.expert_table() is table  # built once
    fused = qlinear.fused_experts(x, table, weights, ids, experts.expert_offset)
    assert fused is not None
    torch.testing.assert_close(experts(x, weights, ids), fused, rtol=0, atol=0)
    # load_model's last step tiles the experts for the CPU kernel: the layer then runs them tiled
    assert tile_for_cpu(loaded.model) > 0
    assert experts.q13 is not None and all(q.tiled for q in experts.q13)
    tiled = experts.expert_table()
    assert tiled is not None and tiled is not table and tiled.tiled
    torch.testing.assert_close(experts(x, weights, ids), fused, rtol=1e-4, atol=1e-5)


def test_at_the_generic_level_quantized_experts_take_the_per_expert_loop(
    tiny_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The test above's sibling for a CPU without AVX2 (the level forced here): no tiled layout, no
    fused call; each expert runs through the generic kernel, exact products of its dequantized weights."""
    if not qlinear.available("generic"):
        missing("a C compiler for the CPU kernels", "install gcc or clang")
    monkeypatch.setattr(isa, "selected", lambda: "generic")
    loaded = _load(tiny_dirs["olmoe"])
    quantize_model(loaded.model, "int8", 32)
    assert tile_for_cpu(loaded.model) == 0
    (_, experts), *_ = list(expert_layers(loaded.model))
    assert experts.q13 is not None and experts.q2 is not None and not any(q.tiled for q in experts.q13)
    x = torch.randn(3, experts.hidden_size)
    weights, ids = route(torch.randn(3, experts.num_experts), 2, renormalize=True)
    table = experts.expert_table()
    assert table is not None and qlinear.fused_experts(x, table, weights, ids) is None
    got = experts(x, weights, ids)
    assert experts.last_path == "grouped"
    want = moe_reference(x, dequantize_experts(experts.q13), dequantize_experts(experts.q2), weights, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
