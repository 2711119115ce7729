"""The KV transfer between two real engines around SmolLM2 (runtime/engine/kv_transfer/): a prefill
engine pins a prompt's blocks, they travel through the wire format, a decode engine starts from them
and generates what an aggregated engine generates, for every KV-cache dtype and across the CPU cache
layouts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvpilot.kernels import switches
from kvpilot.runtime.engine.core import LLMEngine
from kvpilot.runtime.engine.kv_transfer.wire import (
    StreamHeader,
    decode_stream,
    encode_stream,
    plan_runs,
    transfer_blocks,
)
from kvpilot.runtime.engine.protocol import KVExport, KVImport
from kvpilot.runtime.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(300)]

PROMPT_TEXT = (
    "The history of the printing press begins in the fifteenth century, when movable type changed how "
    "books were made and who could read them. Explain the three most important consequences, and say "
    "which of them still shapes how we publish and read today."
)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def run_one(engine: LLMEngine, prompt: list[int], params: SamplingParams, kv: Any = None) -> Any:
    rid = f"r{engine.num_steps}-{len(engine.requests)}"
    engine.add_request(rid, prompt, params, kv=kv)
    seq = engine.requests[rid].seq
    outputs = []
    while engine.has_unfinished():
        outputs += [o for o in engine.step() if o.request_id == rid]
    return seq, outputs


def prefill(engine: LLMEngine, prompt: list[int]) -> dict[str, Any]:
    _, outs = run_one(engine, prompt, SamplingParams(max_tokens=1, temperature=0.0), KVExport())
    params = outs[-1].kv_transfer_params
    assert params is not None and params["num_tokens"] == len(prompt)
    return params


def transfer(src: LLMEngine, dst: LLMEngine, params: dict[str, Any], first_block: int) -> KVImport:
    """What GET /v1/kv/transfers/{id}?from_block=K and the decode side's decode do, in memory (each
    layer cut into runs of at most 2 blocks, so the import meets several runs per layer)."""
    assert src.kv is not None and dst.kv is not None
    layout = src.kv.layout
    with src.kv.open_transfer(params["transfer_id"]) as reader:
        assert reader is not None
        n = reader.num_blocks - first_block
        runs = plan_runs(layout, first_block, n, max_bytes=2 * layout.block_payload_bytes)
        assert n < 3 or len(runs) > layout.num_layers
        sent = [(r, bytes(reader.export_run(r.layer, r.first_block, r.num_blocks))) for r in runs]
        raw = encode_stream(StreamHeader(layout, reader.num_tokens, first_block, n), sent)
    decoded = decode_stream(raw, dst.kv.layout, first_block, n)
    done: list[bool] = []
    return KVImport(first_block, n, [decoded.runs], lambda: done.append(True))


@pytest.fixture
def small(make_engine: Callable[..., LLMEngine]) -> Callable[..., LLMEngine]:
    """Engines with small pools (quick to allocate): 16 MiB, 22 blocks of float32 unless told."""
    return lambda **kw: make_engine(**{"kv_cache_memory": 16 * 2**20, **kw})


@pytest.fixture(scope="module")
def prompt(make_engine: Callable[..., LLMEngine]) -> list[int]:
    ids = list(make_engine().tokenizer.encode(PROMPT_TEXT + " " + PROMPT_TEXT))
    assert len(ids) > 3 * 16
    return ids


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "float32", "int8", "fp8"])
def test_decode_from_pulled_blocks_matches_the_aggregated_run(
    small: Callable[..., LLMEngine], prompt: list[int], kv_cache_dtype: str
) -> None:
    p = small(kv_cache_dtype=kv_cache_dtype, kv_role="prefill")
    d = small(kv_cache_dtype=kv_cache_dtype, kv_role="decode")
    agg = small(kv_cache_dtype=kv_cache_dtype)
    reference, _ = run_one(agg, prompt, GREEDY)

    params = prefill(p, prompt)
    assert p.kv is not None and p.kv.pins.pending == 1
    assert (
        params["kv_cache_dtype"]
        == {"auto": "bfloat16", "float32": "float32", "int8": "int8", "fp8": "float8_e4m3fn"}[kv_cache_dtype]
    )
    imported = transfer(p, d, params, first_block=0)
    assert imported.num_blocks == transfer_blocks(len(prompt), 16)
    seq, outs = run_one(d, prompt, GREEDY, imported)
    assert seq.output_token_ids == reference.output_token_ids
    assert all(o.kv_fallback is None for o in outs)
    # the decode engine computed only the prompt tokens after the pulled blocks
    assert d.prompt_tokens == len(prompt) - imported.num_blocks * 16
    assert p.kv.release_transfer(params["transfer_id"])
    p.step()  # an engine turn gives the blocks back
    assert p.kv.pins.pending == 0 and p.kv.pins.pinned_blocks == 0
    p.block_manager.check_invariants()
    d.block_manager.check_invariants()


@pytest.fixture(scope="module")
def smollm2_bf16(smollm2_gguf_path: Any) -> Any:
    from kvpilot.runtime.config import DEFAULT_MODEL, EngineConfig
    from kvpilot.runtime.load.loader import load_model

    return load_model(EngineConfig(model=DEFAULT_MODEL), torch.device("cpu"), torch.bfloat16)


def test_bfloat16_pools_transfer_too(smollm2_bf16: Any, prompt: list[int]) -> None:
    from kvpilot.runtime.config import EngineConfig
    from kvpilot.runtime.engine.build import engine_from_loaded

    def make(**kw: Any) -> LLMEngine:
        return engine_from_loaded(
            smollm2_bf16, EngineConfig(dtype="bfloat16", kv_cache_memory=64 * 2**20, **kw)
        )

    p, d, agg = make(kv_role="prefill"), make(kv_role="decode"), make()
    reference, _ = run_one(agg, prompt, GREEDY)
    params = prefill(p, prompt)
    assert params["kv_cache_dtype"] == "bfloat16"
    seq, _ = run_one(d, prompt, GREEDY, transfer(p, d, params, 0))
    assert seq.output_token_ids == reference.output_token_ids
    assert d.prompt_tokens < len(prompt)


def test_pods_with_different_cache_layouts_exchange_the_same_blocks(
    small: Callable[..., LLMEngine], prompt: list[int]
) -> None:
    """The prefill engine stores K transposed and V head-major (the C kernel's tiles); the decode engine,
    without the C kernels, plain [block, token, head, dim]: the logical content arrives unchanged."""
    from kvpilot.runtime.engine.kv_transfer.blocks import export_run

    p = small(kv_role="prefill")
    assert p.runner.backend.name == "cpu-paged" and not p.runner.kv_caches[0].k.is_contiguous()
    switches.use(switches.changed(cpu_kernels=False))  # restored after the test (tests/conftest.py)
    d = small(kv_role="decode")
    assert d.runner.kv_caches[0].k.is_contiguous() and d.runner.kv_caches[0].v.is_contiguous()
    params = prefill(p, prompt)
    imported = transfer(p, d, params, 0)
    n = imported.num_blocks
    seq, outs = run_one(d, prompt, SamplingParams(max_tokens=1, temperature=0.0), imported)
    assert all(o.kv_fallback is None for o in outs)
    assert d.prompt_tokens == len(prompt) - n * 16
    assert p.kv is not None
    # the decode pool published the imported blocks in its prefix cache: read them back
    ids = [d.block_manager.cached[h] for h in d.block_manager._full_block_hashes(seq, n * 16)]
    for layer in (0, p.kv.layout.num_layers - 1):
        with p.kv.open_transfer(params["transfer_id"]) as reader:
            assert reader is not None
            sent = bytes(reader.export_run(layer, 0, n))
        assert bytes(export_run(d.runner.kv_caches[layer], ids)) == sent


def test_a_prefix_cache_hit_on_the_decode_side_pulls_only_the_rest(
    small: Callable[..., LLMEngine], prompt: list[int]
) -> None:
    p, d, agg = small(kv_role="prefill"), small(kv_role="decode"), small()
    shared = prompt[: 2 * 16 + 5]  # the decode pod has served a request with the same first two blocks
    run_one(d, shared, SamplingParams(max_tokens=1, temperature=0.0))
    assert d.kv is not None
    have = d.kv.cached_prefix_blocks(prompt, None, None)
    assert have == 2
    params = prefill(p, prompt)
    imported = transfer(p, d, params, first_block=have)
    assert imported.first_block == 2 and imported.num_blocks == transfer_blocks(len(prompt), 16) - 2
    before = d.prompt_tokens
    seq, outs = run_one(d, prompt, GREEDY, imported)
    reference, _ = run_one(agg, prompt, GREEDY)
    assert seq.output_token_ids == reference.output_token_ids
    assert all(o.kv_fallback is None for o in outs)
    assert d.prompt_tokens - before == len(prompt) - transfer_blocks(len(prompt), 16) * 16


def test_blocks_that_follow_an_evicted_prefix_are_recomputed(
    small: Callable[..., LLMEngine], prompt: list[int]
) -> None:
    p, d, agg = small(kv_role="prefill"), small(kv_role="decode"), small()
    params = prefill(p, prompt)
    imported = transfer(p, d, params, first_block=2)  # pulled for two cached blocks the pool no longer has
    seq, outs = run_one(d, prompt, GREEDY, imported)
    reference, _ = run_one(agg, prompt, GREEDY)
    assert [o.kv_fallback for o in outs if o.kv_fallback] == ["evicted"]
    assert seq.output_token_ids == reference.output_token_ids
    assert d.prompt_tokens == len(prompt)


def test_pinning_stops_at_its_share_of_the_pool(small: Callable[..., LLMEngine], prompt: list[int]) -> None:
    """A pool of 64 blocks with room for one transfer's pins (and one block): the second is refused."""
    n = transfer_blocks(len(prompt), 16)
    block_bytes = 2 * 30 * 16 * 3 * 64 * 4  # SmolLM2: 30 layers, 3 KV heads of 64, float32
    p = small(kv_role="prefill", kv_cache_memory=64 * block_bytes, kv_transfer_pin_fraction=(n + 1.5) / 64)
    assert p.block_manager.num_blocks == 64 and p.kv is not None and p.kv.pins.max_blocks == n + 1
    prefill(p, prompt)
    _, outs = run_one(p, prompt[:-1], SamplingParams(max_tokens=1, temperature=0.0), KVExport())
    assert outs[-1].finished and outs[-1].kv_transfer_params is None
    assert p.kv.pins.pending == 1
    # an aborted request pins nothing
    p.add_request("gone", prompt, SamplingParams(max_tokens=5, ignore_eos=True), kv=KVExport())
    p.step()
    out = p.abort("gone")
    assert out is not None and out.kv_transfer_params is None and p.kv.pins.pending == 1
