"""Mixture-of-Experts: routing, the grouped expert computation, and the four families against
transformers' own modeling code.

- `route` against transformers' router modules (Mixtral: always renormalized; Qwen2-MoE, Qwen3-MoE
  and OLMoE: `norm_topk_prob` on and off).
- `moe_grouped` (sort by expert, each expert once on its rows) against `moe_reference` (every expert on
  every token), whole and with the experts split between "ranks" as expert parallelism splits them.
- Tiny random-weight Mixtral, Qwen2-MoE (shared expert, a dense layer), Qwen3-MoE (per-head q/k norm)
  and OLMoE (whole-projection q/k norm, clip_qkv) directories written with transformers: float32
  logits through prefill + paged decode, a varlen batch with chunked prefill and a decode in one
  step, and greedy tokens against `generate`; each on the fused C call for the experts
  (kernels/cpu_moe.py), which the tests check was taken. In bfloat16, a prefill with many rows per
  expert: the fused call where the CPU has AVX512-BF16 (checked), as close to transformers as the
  torch loop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvpilot.kernels import cpu_moe
from kvpilot.runtime.config import EngineConfig
from kvpilot.runtime.load.loader import LoadedModel, load_model
from kvpilot.runtime.load.quantization import expert_layers
from kvpilot.runtime.models import get_model_class
from kvpilot.runtime.models.moe import FusedMoE, moe_grouped, moe_grouped_mm, moe_reference, route
from tests.needs import missing
from tests.runtime.test_model_parity import PagedKV, _write_tiny_tokenizer, rel_diff

REL_TOL = 1e-3  # of the largest reference logit (float32, different op order)
TINY_VOCAB = 96
FAMILIES = ["mixtral", "qwen2moe", "qwen3moe", "olmoe"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---------------------------------------------------------------------------------------------
# Routing and the expert computation


@pytest.mark.parametrize(
    ("family", "norm"),
    [("mixtral", True), ("qwen2moe", False), ("qwen2moe", True), ("olmoe", False), ("qwen3moe", True)],
)
def test_route_matches_transformers_router(family: str, norm: bool) -> None:
    import transformers as tf
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    common = dict(hidden_size=32, num_experts_per_tok=3)
    router: Any
    if family == "mixtral":
        router = MixtralTopKRouter(tf.MixtralConfig(**common, num_local_experts=8))
    elif family == "qwen2moe":
        router = Qwen2MoeTopKRouter(tf.Qwen2MoeConfig(**common, num_experts=8, norm_topk_prob=norm))
    elif family == "qwen3moe":
        router = Qwen3MoeTopKRouter(tf.Qwen3MoeConfig(**common, num_experts=8, norm_topk_prob=norm))
    else:
        router = OlmoeTopKRouter(tf.OlmoeConfig(**common, num_experts=8, norm_topk_prob=norm))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 32, generator=g))
    x = torch.randn(50, 32, generator=g)
    logits, ref_weights, ref_ids = router(x)
    weights, ids = route(logits, 3, renormalize=norm)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights.float(), rtol=1e-6, atol=1e-7)
    assert torch.allclose(weights.sum(-1), torch.ones(50)) == norm


def _random_moe(t: int, e: int, k: int, h: int = 24, i: int = 16, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, i, generator=g) / i**0.5
    weights, ids = route(torch.randn(t, e, generator=g), k, renormalize=True)
    return x, w13, w2, weights, ids


GROUPED = {"loop": moe_grouped, "grouped_mm": moe_grouped_mm}  # CPU/default path, CUDA path


@pytest.mark.parametrize("impl", GROUPED)
@pytest.mark.parametrize(("t", "e", "k"), [(1, 4, 2), (7, 8, 2), (64, 16, 4), (33, 6, 6)])
def test_grouped_matches_reference(impl: str, t: int, e: int, k: int) -> None:
    x, w13, w2, weights, ids = _random_moe(t, e, k, seed=t)
    ref = moe_reference(x, w13, w2, weights, ids)
    torch.testing.assert_close(GROUPED[impl](x, w13, w2, weights, ids), ref, rtol=1e-5, atol=1e-5)
    if (
        t == 1 and impl == "loop"
    ):  # a decode of one token touches only its k experts: the others' weights are never read
        unused = torch.ones(e, dtype=torch.bool)
        unused[ids[0]] = False
        w13[unused] = float("nan")
        assert not moe_grouped(x, w13, w2, weights, ids).isnan().any()


@pytest.mark.parametrize("impl", GROUPED)
def test_grouped_empty_batch(impl: str) -> None:
    x, w13, w2, weights, ids = _random_moe(3, 4, 2)
    out = GROUPED[impl](x[:0], w13, w2, weights[:0], ids[:0])
    assert out.shape == (0, x.shape[1])


@pytest.mark.parametrize("impl", GROUPED)
@pytest.mark.parametrize("ranks", [2, 4])
def test_grouped_expert_shards_sum_to_whole(impl: str, ranks: int) -> None:
    """Expert parallelism: each rank's partial over its E / ranks experts; the sum is the whole."""
    x, w13, w2, weights, ids = _random_moe(40, 8, 2, seed=5)
    whole = moe_reference(x, w13, w2, weights, ids)
    per = 8 // ranks
    parts = [
        GROUPED[impl](x, w13[r * per : (r + 1) * per], w2[r * per : (r + 1) * per], weights, ids, r * per)
        for r in range(ranks)
    ]
    refs = [
        moe_reference(x, w13[r * per : (r + 1) * per], w2[r * per : (r + 1) * per], weights, ids, r * per)
        for r in range(ranks)
    ]
    for part, ref in zip(parts, refs, strict=True):
        torch.testing.assert_close(part, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sum(parts), whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", GROUPED)
def test_grouped_bfloat16_close_to_float32(impl: str) -> None:
    x, w13, w2, weights, ids = _random_moe(32, 8, 2, h=64, i=32, seed=9)
    ref = moe_reference(x, w13, w2, weights, ids)
    ours = GROUPED[impl](x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids).float()
    assert float((ours - ref).abs().max() / ref.abs().max()) < 3e-2


# ---------------------------------------------------------------------------------------------
# Tiny random-weight families against transformers


def tiny_moe_hf_model(family: str, **overrides: Any) -> Any:
    import transformers as tf

    common: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        eos_token_id=2,
        bos_token_id=1,
        pad_token_id=0,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    if family == "mixtral":
        common["intermediate_size"] = 32
        return tf.MixtralForCausalLM(tf.MixtralConfig(**common, num_local_experts=8))
    if family == "qwen2moe":  # layer 1 dense (mlp_only_layers); a shared expert
        cfg = tf.Qwen2MoeConfig(
            **common,
            num_experts=6,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
            mlp_only_layers=[1],
        )
        return tf.Qwen2MoeForCausalLM(cfg)
    if family == "qwen3moe":
        cfg3 = tf.Qwen3MoeConfig(**common, num_experts=8, moe_intermediate_size=32, norm_topk_prob=True)
        return tf.Qwen3MoeForCausalLM(cfg3)
    cfgo = tf.OlmoeConfig(
        **common, num_experts=8, norm_topk_prob=False, clip_qkv=float(common.get("clip_qkv", 0.5))
    )
    return tf.OlmoeForCausalLM(cfgo)


def make_tiny_moe_dir(family: str, directory: Path, **overrides: Any) -> Any:
    torch.manual_seed(2024)
    model = tiny_moe_hf_model(family, **overrides).to(torch.float32).eval()
    with torch.no_grad():  # random everything, biases and norms included
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    model.save_pretrained(directory)
    _write_tiny_tokenizer(directory)
    return model


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Any, LoadedModel]:
    family = str(request.param)
    directory = tmp_path_factory.mktemp(family)
    hf = make_tiny_moe_dir(family, directory)
    loaded = load_model(EngineConfig(model=str(directory)), torch.device("cpu"), torch.float32)
    return family, hf, loaded


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, TINY_VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_logits(hf: Any, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def test_arch_config(tiny: tuple[str, Any, LoadedModel]) -> None:
    family, _, loaded = tiny
    arch = loaded.arch
    assert get_model_class(arch.architecture).__name__ == "MoEForCausalLM"
    assert arch.is_moe and arch.num_experts_per_tok == 2
    expected = {"mixtral": (8, True, 0, (), None), "qwen2moe": (6, False, 48, (1,), None)}
    expected |= {"qwen3moe": (8, True, 0, (), "head"), "olmoe": (8, False, 0, (), "full")}
    got = (arch.num_experts, arch.norm_topk_prob, arch.shared_expert_intermediate_size, arch.dense_mlp_layers)
    assert (*got, arch.qk_norm) == expected[family]
    assert arch.qkv_bias == (family == "qwen2moe")
    assert arch.clip_qkv == (0.5 if family == "olmoe" else None)


FUSED = "cpu_fused" if cpu_moe.available() else "grouped"  # what the tiny models' experts run on


def _paths(model: torch.nn.Module) -> set[str]:
    """What each MoE layer's experts ran on in the model's last forward."""
    return {experts.last_path for _, experts in expert_layers(model)}


def test_prefill_and_decode_logits_match_transformers(tiny: tuple[str, Any, LoadedModel]) -> None:
    family, hf, loaded = tiny
    ids = _ids(29, 7)
    ref = _hf_logits(hf, ids)
    kv = PagedKV(loaded.arch, num_blocks=16, block_size=8)
    prefill = kv.logits(loaded.model, [(0, ids[:20])])
    assert _paths(loaded.model) == {FUSED}
    decodes = [kv.logits(loaded.model, [(0, [t])]) for t in ids[20:]]
    assert _paths(loaded.model) == {FUSED}
    _, rel = rel_diff(torch.cat([prefill, *decodes]), ref)
    print(f"\ntiny {family}: prefill + decode logits within {rel:.2g} of scale")
    assert rel <= REL_TOL


def test_batched_chunked_prefill_matches_transformers(tiny: tuple[str, Any, LoadedModel]) -> None:
    """Two prompts in one step, the second prefilled in two chunks, the second chunk sharing a step
    with the first prompt's decode: every row's logits are transformers' for its own sequence."""
    family, hf, loaded = tiny
    a, b = _ids(11, 1), _ids(37, 2)
    ref_a, ref_b = _hf_logits(hf, [*a, 42]), _hf_logits(hf, b)
    kv = PagedKV(loaded.arch, num_blocks=32, block_size=8, seed=3)
    first = kv.logits(loaded.model, [(0, a), (1, b[:19])])
    assert _paths(loaded.model) == {FUSED}
    second = kv.logits(loaded.model, [(0, [42]), (1, b[19:])])
    assert _paths(loaded.model) == {FUSED}
    worst = max(
        rel_diff(first[: len(a)], ref_a[: len(a)])[1],
        rel_diff(first[len(a) :], ref_b[:19])[1],
        rel_diff(second[:1], ref_a[-1:])[1],
        rel_diff(second[1:], ref_b[19:])[1],
    )
    print(f"\ntiny {family}: batched + chunked prefill within {worst:.2g} of scale")
    assert worst <= REL_TOL


def test_greedy_tokens_match_generate(tiny: tuple[str, Any, LoadedModel]) -> None:
    family, hf, loaded = tiny
    prompt = _ids(13, 9)
    steps = 12
    kv = PagedKV(loaded.arch, num_blocks=16, block_size=8, seed=4)
    ours = [int(kv.logits(loaded.model, [(0, prompt)])[-1].argmax())]
    for _ in range(steps - 1):
        ours.append(int(kv.logits(loaded.model, [(0, [ours[-1]])])[-1].argmax()))
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
            max_new_tokens=steps,
            do_sample=False,
            eos_token_id=None,
        )
    assert ours == out[0, len(prompt) :].tolist(), family
    assert _paths(loaded.model) == {FUSED}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpu_layer_takes_the_fused_call_up_to_the_crossover(dtype: torch.dtype) -> None:
    """FusedMoE on the CPU: the fused C call (kernels/cpu_moe.py) for up to max_rows_per_expert
    rows per held expert (float32: MAX_ROWS_PER_EXPERT; bfloat16 with AVX512-BF16: every count,
    prefill too), exactly cpu_moe.fused_experts' result; above that and with `use_cpu_kernel` off,
    the per-expert torch loop, which it agrees with."""
    if not cpu_moe.available():
        missing("kernels/csrc/moe_cpu.c built", "a C compiler (gcc/cc) on PATH")
    e, k = 8, 2
    layer = FusedMoE(e, 24, 16)
    _, w13, w2, _, _ = _random_moe(1, e, k)
    layer.w13.data = w13.to(dtype)
    layer.w2.data = w2.to(dtype)
    # bfloat16: the loop rounds g, u, each expert's output and the combine to bfloat16 (a few steps of
    # 2^-8 on outputs of size ~1), the fused call only the activation and the result
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    fits = cpu_moe.MAX_ROWS_PER_EXPERT * e // k  # tokens
    beyond = "cpu_fused" if cpu_moe.max_rows_per_expert(dtype) == float("inf") else "grouped"
    assert beyond == ("cpu_fused" if dtype == torch.bfloat16 and cpu_moe.bf16_dot() else "grouped")
    for t, path in ((1, "cpu_fused"), (fits, "cpu_fused"), (fits + 1, beyond), (8 * fits, beyond)):
        xs, _, _, weights, ids = _random_moe(t, e, k, seed=t)
        xs = xs.to(dtype)
        out = layer(xs, weights, ids)
        assert layer.last_path == path, t
        if path == "cpu_fused":
            torch.testing.assert_close(
                out, cpu_moe.fused_experts(xs, layer.w13, layer.w2, weights, ids), rtol=0, atol=0
            )
        layer.use_cpu_kernel = False
        loop = layer(xs, weights, ids)
        assert layer.last_path == "grouped"
        layer.use_cpu_kernel = True
        torch.testing.assert_close(out.float(), loop.float(), **tol)


def test_unsupported_architecture_names_the_supported_ones(tmp_path: Path) -> None:
    make_tiny_moe_dir("mixtral", tmp_path)
    cfg = (tmp_path / "config.json").read_text().replace("MixtralForCausalLM", "DeepseekV3ForCausalLM")
    (tmp_path / "config.json").write_text(cfg)
    with pytest.raises(ValueError, match=r"'DeepseekV3ForCausalLM' is not supported.*OlmoeForCausalLM"):
        load_model(EngineConfig(model=str(tmp_path)), torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("family", ["mixtral", "olmoe"])
def test_bfloat16_prefill_takes_the_fused_call_and_tracks_transformers(family: str, tmp_path: Path) -> None:
    """A bfloat16 model's prefill with many rows per expert (here ~35, above MAX_ROWS_PER_EXPERT):
    on a CPU with AVX512-BF16 the experts run as the fused C call (cpu_moe.max_rows_per_expert),
    else the per-expert torch loop; either way its logits are at least about as close to
    transformers' float32 ones as the bfloat16 torch loop's are."""
    if not cpu_moe.available():
        missing("kernels/csrc/moe_cpu.c built", "a C compiler (gcc/cc) on PATH")
    hf = make_tiny_moe_dir(family, tmp_path, max_position_embeddings=256)
    loaded = load_model(EngineConfig(model=str(tmp_path)), torch.device("cpu"), torch.bfloat16)
    ids = _ids(140, 5)  # 280 assignments over 8 experts
    assert len(ids) * loaded.arch.num_experts_per_tok / loaded.arch.num_experts > cpu_moe.MAX_ROWS_PER_EXPERT
    ref = _hf_logits(hf, ids)

    def prefill() -> torch.Tensor:
        kv = PagedKV(loaded.arch, num_blocks=24, block_size=8)
        kv.caches = [type(c)(c.k.bfloat16(), c.v.bfloat16()) for c in kv.caches]
        return kv.logits(loaded.model, [(0, ids)]).float()

    fused = prefill()
    native = cpu_moe.bf16_dot()
    assert _paths(loaded.model) == {"cpu_fused" if native else "grouped"}
    layers = [experts for _, experts in expert_layers(loaded.model)]
    for experts in layers:
        experts.use_cpu_kernel = False
    loop = prefill()
    assert _paths(loaded.model) == {"grouped"}
    _, rel_fused = rel_diff(fused, ref)
    _, rel_loop = rel_diff(loop, ref)
    print(f"\ntiny {family} bf16 prefill: fused {rel_fused:.2g}, torch loop {rel_loop:.2g} of scale")
    assert rel_fused <= 1.5 * rel_loop + 1e-3
    assert rel_loop < 0.1  # bfloat16 end to end: a few percent of the largest logit
