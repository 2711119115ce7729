"""Multi-LoRA serving against PEFT's own merged models.

A tiny random-weight Llama with SmolLM2's shape of choices (tied embeddings, no biases, grouped KV
heads: 4 query heads over 2 KV heads, so tensor parallelism splits the KV heads), written with
transformers, and three random adapters of different ranks and targets written with `peft`. The
reference for each adapter is PEFT's `merge_and_unload()` model run greedily by transformers. One
batch mixes the base model and all three adapters (two of them on the same prompt, so a prefix-cache
mix-up would show), with chunked prefill; the logits of every sampled token must agree in float32
and the greedy tokens must be equal, at tp=1 and tp=2, with every adapter resident and with fewer
slots than adapters (LRU eviction), and under preemption.

Bad adapters (a different hidden size, a rank over --max-lora-rank, an unknown target module,
missing files) are refused with a message naming the adapter and the problem, and the engine keeps
serving what it had.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvpilot.runtime.config import ConfigError, EngineConfig
from kvpilot.runtime.engine.block_manager import hash_block
from kvpilot.runtime.engine.build import build_engine, engine_from_loaded
from kvpilot.runtime.engine.core import LLMEngine
from kvpilot.runtime.engine.runner import ModelRunner, StepLogits
from kvpilot.runtime.engine.sampling_params import SamplingParams
from kvpilot.runtime.engine.scheduler import ScheduledSeq
from kvpilot.runtime.lora.access import refusal, startup_notice
from kvpilot.runtime.lora.adapter import LoRAError, parse_lora_modules
from kvpilot.runtime.lora.errors import AdapterPathError
from kvpilot.runtime.lora.layers import build_lora_batch
from kvpilot.runtime.lora.manager import SlotTable
from tests.needs import require_module
from tests.runtime.greedy_reference import Reference, assert_matches_reference, hf_greedy

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("no_tp_leftovers")]

# float32: a merged W + s B A against W x + s (x A^T) B^T differs only by rounding (~1e-7 of scale)
REL_TOL = 1e-4
MAX_TOKENS = 10
VOCAB = 96

# name -> (rank, alpha, rslora, target modules)
ADAPTERS: dict[str, tuple[int, int, bool, list[str]]] = {
    "sql": (4, 8, False, ["q_proj", "v_proj"]),
    "chat": (8, 16, False, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "math": (16, 8, True, ["o_proj", "gate_proj", "up_proj", "down_proj"]),
}
# one batch: the base model and every adapter; "chat" and "sql" share a prompt
BATCH: list[tuple[str | None, int]] = [(None, 0), ("sql", 1), ("chat", 2), ("math", 3), ("chat", 1)]


def llama_config(hidden: int = 64) -> Any:
    import transformers as tf

    return tf.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
        tie_word_embeddings=True,
        eos_token_id=2,
        bos_token_id=1,
    )


def random_llama(hidden: int = 64, seed: int = 1234) -> Any:
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(llama_config(hidden))
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    return model.float().eval()


def write_base(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    random_llama().save_pretrained(directory)
    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))


def write_adapter(
    base: Any, directory: Path, rank: int, alpha: int, rslora: bool, targets: list[str], seed: int
) -> None:
    """A PEFT adapter with random A and B (PEFT itself starts B at zero, which would test nothing)."""
    peft = require_module("peft", "pip install -e .[test]")
    cfg = peft.LoraConfig(
        r=rank, lora_alpha=alpha, use_rslora=rslora, target_modules=targets, lora_dropout=0.0
    )
    model = peft.get_peft_model(base, cfg)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.3)
    model.save_pretrained(str(directory))


def merged_reference(base_dir: Path, adapter_dir: Path | None) -> Any:
    """PEFT's merged model (the base model itself without an adapter), float32."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    if adapter_dir is not None:
        peft = require_module("peft", "pip install -e .[test]")
        model = peft.PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    return model.eval()


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    lengths = [5, 23, 41, 17]  # one block, several blocks, chunked over steps (32-token budget)
    return [torch.randint(3, 90, (k,), generator=g).tolist() for k in lengths]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_module("peft", "pip install -e .[test]")
    root = tmp_path_factory.mktemp("lora")
    write_base(root / "base")
    for i, (name, (rank, alpha, rslora, targets)) in enumerate(ADAPTERS.items()):
        write_adapter(random_llama(), root / name, rank, alpha, rslora, targets, seed=100 + i)
    return root


@pytest.fixture(scope="module")
def references(workdir: Path) -> list[Reference]:
    """PEFT-merged greedy outputs and logits for every entry of BATCH."""
    ps = prompts()
    cache: dict[str | None, Any] = {}
    out = []
    for adapter, prompt in BATCH:
        if adapter not in cache:
            cache[adapter] = merged_reference(
                workdir / "base", None if adapter is None else workdir / adapter
            )
        out.append(hf_greedy(cache[adapter], ps[prompt], MAX_TOKENS, {-1}))
    return out


def engine_config(workdir: Path, tp: int = 1, **overrides: Any) -> EngineConfig:
    settings: dict[str, Any] = {
        "model": str(workdir / "base"),
        "device": "cpu",
        "dtype": "float32",
        "kv_cache_dtype": "float32",  # the float32 arithmetic peft's merged model is compared with
        "threads": 1,
        "tensor_parallel_size": tp,
        "kv_cache_memory": 4 << 20,
        "block_size": 8,
        "max_num_batched_tokens": 32,
        "lora_modules": {name: str(workdir / name) for name in ADAPTERS},
        "max_loras": 4,
        "max_lora_rank": 16,
        **overrides,
    }
    return EngineConfig(**settings)


@pytest.fixture
def start() -> Iterator[Callable[[EngineConfig], LLMEngine]]:
    engines: list[LLMEngine] = []

    def make(cfg: EngineConfig) -> LLMEngine:
        engine = build_engine(cfg)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


def run_batch(engine: LLMEngine) -> tuple[list[Reference], list[set[str | None]]]:
    """Greedy outputs of BATCH with each sampled row's logits, and the adapters of each step."""
    seen: dict[str, list[torch.Tensor]] = {}
    steps: list[set[str | None]] = []
    execute = engine.runner.execute

    def recording(scheduled: list[ScheduledSeq]) -> StepLogits:
        steps.append({s.seq.lora.name if s.seq.lora else None for s in scheduled})
        step = execute(scheduled)
        for row, s in zip(step.logits, step.sampled, strict=True):
            seen.setdefault(s.seq.seq_id, []).append(row.clone())
        return step

    engine.runner.execute = recording  # type: ignore[method-assign]
    ps = prompts()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    seqs = engine.generate([ps[p] for _, p in BATCH], params, loras=[a for a, _ in BATCH])
    return [Reference(s.output_token_ids, seen[s.seq_id]) for s in seqs], steps


def compare(ours: list[Reference], refs: list[Reference], label: str) -> float:
    worst = 0.0
    for (adapter, _), a, b in zip(BATCH, ours, refs, strict=True):
        what = f"{label} {adapter or 'base'}"
        assert len(a.tokens) == MAX_TOKENS
        assert_matches_reference(a.tokens, b, what)
        same = next(
            (j for j, (x, y) in enumerate(zip(a.tokens, b.tokens, strict=False)) if x != y), MAX_TOKENS
        )
        for mine, theirs in zip(a.logits[: same + 1], b.logits[: same + 1], strict=True):
            diff = float((mine - theirs).abs().max() / theirs.abs().max())
            assert diff <= REL_TOL, f"{what}: logits differ by {diff:.2e} of scale"
            worst = max(worst, diff)
    return worst


def test_adapters_change_the_model(references: list[Reference]) -> None:
    """The check below means something: each adapter's merged model differs from the base model."""
    base = references[0].logits[0]
    chat_vs_sql = references[4].logits[0] - references[1].logits[0]  # same prompt, two adapters
    assert float(chat_vs_sql.abs().max()) > 0.1 * float(base.abs().max())


@pytest.mark.parametrize(("tp", "max_loras"), [(1, 4), (1, 2), (2, 4)])
def test_mixed_batch_matches_peft_merged(
    tp: int,
    max_loras: int,
    workdir: Path,
    references: list[Reference],
    start: Callable[[EngineConfig], LLMEngine],
) -> None:
    engine = start(engine_config(workdir, tp, max_loras=max_loras))
    ours, steps = run_batch(engine)
    worst = compare(ours, references, f"tp={tp} max_loras={max_loras}")
    assert engine.runner.lora_slots is not None
    if max_loras >= len(ADAPTERS):
        # the base model and all three adapters ran in the same steps
        assert any(s == {None, *ADAPTERS} for s in steps), steps
        assert engine.runner.lora_slots.evictions == 0
    else:
        assert all(len(s - {None}) <= max_loras for s in steps), steps
        assert engine.runner.lora_slots.evictions > 0  # an adapter went back to host memory and returned
    print(f"\ntp={tp} max_loras={max_loras}: logits within {worst:.2e} of scale of PEFT's merged models")


def test_preemption_keeps_each_sequence_on_its_adapter(
    workdir: Path, references: list[Reference], start: Callable[[EngineConfig], LLMEngine]
) -> None:
    engine = start(engine_config(workdir, kv_cache_memory=1 << 16))  # 16 blocks of 8 tokens
    ours, _ = run_batch(engine)
    assert engine.scheduler.num_preemptions > 0
    compare(ours, references, "preempted")


def test_ngram_speculation_verifies_with_each_sequences_adapter(
    workdir: Path, references: list[Reference], start: Callable[[EngineConfig], LLMEngine]
) -> None:
    cfg = engine_config(workdir, speculative_method="ngram", num_speculative_tokens=3)
    engine = start(cfg.model_copy(update={"speculative_adaptive": False}))
    ps = prompts()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    seqs = engine.generate([ps[p] for _, p in BATCH], params, loras=[a for a, _ in BATCH])
    assert engine.speculator is not None and engine.speculator.stats.num_draft_tokens > 0
    for (adapter, _), seq, ref in zip(BATCH, seqs, references, strict=True):
        assert_matches_reference(seq.output_token_ids, ref, f"ngram {adapter or 'base'}")


def test_prefix_cache_is_per_adapter(workdir: Path, start: Callable[[EngineConfig], LLMEngine]) -> None:
    engine = start(engine_config(workdir))
    prompt = prompts()[2]  # 41 tokens: 5 full blocks
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

    def cached(lora: str | None) -> int:
        engine.add_request(f"r-{lora}-{engine.num_steps}", prompt, params, lora=lora)
        seq = next(iter(engine.requests.values())).seq
        while engine.has_unfinished():
            engine.step()
        return seq.num_cached_tokens

    assert cached("chat") == 0
    assert cached("sql") == 0  # same tokens, another adapter: nothing shared
    assert cached(None) == 0  # nor with the base model
    assert cached("chat") == 40  # the same adapter again: its 5 blocks are reused
    # a reload under the same name is a new adapter: the old blocks are not reused
    engine.add_lora("chat", str(workdir / "chat"))
    assert cached("chat") == 0
    assert hash_block(None, [1, 2], None, "a#1") != hash_block(None, [1, 2], None, "a#2")


# ---------------------------------------------------------------------------------------------
# Bad input


def adapter_variant(workdir: Path, tmp: Path, kind: str) -> Path:
    out = tmp / kind
    if kind == "hidden":  # trained on a model of hidden size 32
        write_adapter(random_llama(hidden=32), out, 4, 8, False, ["q_proj", "v_proj"], seed=5)
    elif kind == "rank":
        write_adapter(random_llama(), out, 32, 32, False, ["q_proj"], seed=6)
    elif kind == "target":
        write_adapter(random_llama(), out, 4, 8, False, ["q_proj", "embed_tokens"], seed=7)
    elif kind == "no-weights":
        shutil.copytree(workdir / "sql", out)
        (out / "adapter_model.safetensors").unlink()
    elif kind == "no-config":
        shutil.copytree(workdir / "sql", out)
        (out / "adapter_config.json").unlink()
    elif kind == "layers":  # a deeper model's adapter: its layer 2 does not exist here
        import transformers as tf

        cfg = llama_config()
        cfg.num_hidden_layers = 3
        write_adapter(tf.LlamaForCausalLM(cfg), out, 4, 8, False, ["q_proj"], seed=8)
    return out


BAD = {
    "hidden": "hidden size differs",
    "rank": "rank 32 is over the limit of 16",
    "target": "unknown target modules ['embed_tokens']",
    "no-weights": "adapter_model.safetensors is missing",
    "no-config": "adapter_config.json is missing",
    "missing": "does not exist",
    "layers": "layer 2 is beyond the base model's 2 layers",
}


PATH_KINDS = {"no-weights", "no-config", "missing"}  # the path names no usable adapter folder


@pytest.mark.parametrize("kind", sorted(BAD))
def test_bad_adapter_is_refused_and_serving_goes_on(
    kind: str, workdir: Path, tmp_path: Path, start: Callable[[EngineConfig], LLMEngine]
) -> None:
    engine = start(engine_config(workdir, lora_modules={"sql": str(workdir / "sql")}))
    path = tmp_path / "nowhere" if kind == "missing" else adapter_variant(workdir, tmp_path, kind)
    with pytest.raises(LoRAError) as err:
        engine.add_lora("broken", str(path))
    assert "'broken'" in str(err.value) and BAD[kind] in str(err.value), str(err.value)
    if kind in PATH_KINDS:  # the log and `kvpilot serve` get the reason; an API client one message
        assert isinstance(err.value, AdapterPathError)
        assert str(tmp_path) not in err.value.client_message and BAD[kind] not in err.value.client_message
    else:  # the adapter's own problem: the client gets the whole message
        assert err.value.client_message == str(err.value)
    assert set(engine.adapters.names()) == {"sql"}
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    seqs = engine.generate([prompts()[0]] * 2, params, loras=["sql", None])
    assert all(len(s.output_token_ids) == 3 for s in seqs)
    with pytest.raises(ValueError, match="'broken' is not loaded"):
        engine.add_request("x", prompts()[0], params, lora="broken")


def test_bad_adapter_at_start_names_it(workdir: Path, tmp_path: Path) -> None:
    bad = adapter_variant(workdir, tmp_path, "rank")
    with pytest.raises(ConfigError, match=r"--lora-modules big=.*'big'.*rank 32 is over the limit of 16"):
        build_engine(engine_config(workdir, lora_modules={"big": str(bad)}))


BAD_NAMES = ["../evil name", "a/b", ".hidden", "x" * 64, "naïve"]


@pytest.mark.parametrize("name", [*BAD_NAMES, "", "sql\n"])
def test_adapter_names_follow_the_crds_rule(
    name: str, workdir: Path, start: Callable[[EngineConfig], LLMEngine]
) -> None:
    """spec.adapters[].name's rule (kvpilot.api.models) for the engine's adapters."""
    engine = start(engine_config(workdir, lora_modules={}, enable_lora=True))
    with pytest.raises(LoRAError, match="must be 1-63 letters, digits"):
        engine.add_lora(name, str(workdir / "sql"))
    assert engine.adapters.names() == []
    engine.add_lora("Sql_v2.1-a", str(workdir / "sql"))  # letters of either case, digits, '_', '.', '-'


@pytest.mark.parametrize("name", BAD_NAMES)
def test_lora_modules_names_follow_the_rule(name: str) -> None:
    from kvpilot.runtime import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    with pytest.raises(ValueError, match=r"invalid setting --lora-modules: adapter name .* must be 1-63"):
        cli.build_config(parser.parse_args(["--lora-modules", "ok=/x", f"{name}=/x"]))


def test_adapter_names_in_a_config_file_follow_the_rule(tmp_path: Path) -> None:
    from kvpilot.runtime import cli

    (tmp_path / "c.yaml").write_text('lora_modules: {"../evil name": /x}\n')
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    with pytest.raises(ValueError, match=r"c\.yaml: lora_modules: adapter name '\.\./evil name' must be"):
        cli.build_config(parser.parse_args(["--config", str(tmp_path / "c.yaml")]))


def test_unload_refuses_while_in_use_then_unloads(
    workdir: Path, start: Callable[[EngineConfig], LLMEngine]
) -> None:
    engine = start(engine_config(workdir))
    engine.add_request("busy", prompts()[0], SamplingParams(max_tokens=4, ignore_eos=True), lora="math")
    with pytest.raises(LoRAError, match="'math' cannot be unloaded: 1 unfinished requests use it"):
        engine.remove_lora("math")
    while engine.has_unfinished():
        engine.step()
    engine.remove_lora("math")
    assert set(engine.adapters.names()) == {"sql", "chat"}
    with pytest.raises(LoRAError, match="'math' is not loaded"):
        engine.remove_lora("math")


# ---------------------------------------------------------------------------------------------
# Pure parts


def test_slot_table_evicts_least_recently_used() -> None:
    table = SlotTable(2)
    slots, loads = table.plan(["a", "b"])
    assert loads == [(0, "a"), (1, "b")] and slots == {"a": 0, "b": 1}
    assert table.plan(["a"]) == ({"a": 0}, [])  # a is now the most recent
    slots, loads = table.plan(["c", "a"])
    assert loads == [(1, "c")] and slots == {"c": 1, "a": 0} and table.evictions == 1
    with pytest.raises(RuntimeError, match="--max-loras is 2"):
        table.plan(["a", "b", "c"])


def test_lora_batch_grouping() -> None:
    # decode-like: even groups -> one padded gather; base tokens (-1) are in no group
    even = build_lora_batch([0, -1, 1, 0, 1], [4, 8], torch.device("cpu"), torch.float32)
    assert even is not None and even.gather is not None and even.inverse is not None
    assert even.slots.tolist() == [0, 1] and even.rank == 8 and even.group_len == 2
    assert even.first_slot == 0  # consecutive slots: the buffers are read in place
    assert even.gather.tolist() == [0, 3, 2, 4] and even.inverse.tolist() == [0, 0, 2, 1, 3]
    assert even.token_mask is not None and even.token_mask.squeeze(1).tolist() == [1, 0, 1, 1, 1]
    # base rows first, then equal groups in slot order: a view, no gather
    dense = build_lora_batch([-1, 0, 0, 1, 1], [4, 4], torch.device("cpu"), torch.float32)
    assert dense is not None and dense.dense_start == 1 and dense.group_len == 2 and dense.gather is None
    padded = build_lora_batch([0, 0, 0, 1], [4, 4], torch.device("cpu"), torch.float32)
    assert padded is not None and padded.gather is not None and padded.token_mask is None
    assert padded.gather.tolist() == [0, 1, 2, 3, 3, 3] and padded.group_len == 3
    # a long prefill chunk beside two decodes: per-group rows, the chunk as a slice
    uneven = build_lora_batch([1] * 20 + [-1, 0, 2, 1], [4, 8, 4], torch.device("cpu"), torch.float32)
    assert uneven is not None and uneven.gather is None
    assert uneven.rows[0] == slice(21, 22) and uneven.rows[2] == slice(22, 23)
    assert isinstance(uneven.rows[1], torch.Tensor) and uneven.rows[1].tolist() == [*range(20), 23]
    gap = build_lora_batch([0, 2], [4, 0, 8], torch.device("cpu"), torch.float32)
    assert gap is not None and gap.first_slot is None and gap.rank == 8
    assert build_lora_batch([-1, -1], [4], torch.device("cpu"), torch.float32) is None


def test_runtime_updates_need_the_api_key_or_the_opt_in() -> None:
    assert refusal(False, True, False) is not None and refusal(False, True, False)[0] == 404
    off = refusal(False, False, True)
    assert off is not None and off[0] == 404 and "--enable-lora-runtime-updates" in off[2]
    no_key = refusal(True, False, False)
    assert no_key is not None and no_key[:2] == (403, "permission_error")
    assert "--allow-lora-updates-without-api-key" in no_key[2] and "--api-key" in no_key[2]
    assert refusal(True, True, False) is None  # the key is checked for every /v1 route
    assert refusal(True, False, True) is None
    # at start: a warning whenever the endpoints are on without a key, a note when the opt-in is moot
    assert startup_notice(False, False, True) is None and startup_notice(True, True, False) is None
    opted_in = startup_notice(True, False, True)
    assert opted_in is not None and opted_in[0] == logging.WARNING and "any client" in opted_in[1]
    refused = startup_notice(True, False, False)
    assert refused is not None and refused[0] == logging.WARNING and "403" in refused[1]
    moot = startup_notice(True, True, True)
    assert moot is not None and moot[0] == logging.INFO and "no effect" in moot[1]


def test_parse_lora_modules() -> None:
    assert parse_lora_modules(["a=/x", "b = /y"]) == {"a": "/x", "b": "/y"}
    with pytest.raises(ValueError, match="--lora-modules: expected NAME=PATH"):
        parse_lora_modules(["nopath"])
    with pytest.raises(ValueError, match="given twice"):
        parse_lora_modules(["a=/x", "a=/y"])


def test_a_runner_without_lora_on_the_same_model_is_the_base_model(
    workdir: Path, start: Callable[[EngineConfig], LLMEngine]
) -> None:
    """Engines may share one loaded model (tests, benchmarks): an adapter step of one must not leak
    into the next forward of another that serves no adapters."""
    from kvpilot.runtime.load.loader import load_model

    cfg = engine_config(workdir)
    loaded = load_model(cfg, "cpu", torch.float32)
    plain = engine_from_loaded(loaded, cfg.model_copy(update={"lora_modules": {}, "enable_lora": False}))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    before = plain.generate([prompts()[1]], params)[0].output_token_ids
    with_lora = engine_from_loaded(loaded, cfg)  # attaches the slots to the shared model
    with_lora.generate([prompts()[0]] * 4, params, loras=["chat", "sql", "math", "chat"])
    assert plain.generate([prompts()[1]], params)[0].output_token_ids == before


def test_base_only_step_leaves_the_model_untouched(
    workdir: Path, start: Callable[[EngineConfig], LLMEngine]
) -> None:
    """With adapters loaded but none in the step, no LoRA work is set up at all."""
    engine = start(engine_config(workdir))
    engine.generate([prompts()[0]], SamplingParams(max_tokens=2), loras=["chat"])
    engine.generate([prompts()[0]], SamplingParams(max_tokens=2))
    assert isinstance(engine.runner, ModelRunner) and engine.runner.lora is not None
    assert engine.runner.lora.ctx.batch is None


@pytest.mark.parametrize(
    "token_slots",
    [
        [-1, 0, 0, 1, 1, 3, 3],  # dense: base rows first, equal groups in slot order
        [0, -1, 1, 0, 1],  # padded gather, consecutive slots read in place
        [0, 2, 0, -1, 2],  # padded gather, slots 0 and 2: gathered, rank sliced
        [3] * 12 + [0, -1, 2],  # per-group rows (a slice and single rows), gathered slots
        [2, 0, 1] + [2] * 12,  # per-group rows with an index tensor, slots read in place
    ],
)
def test_every_grouping_adds_each_tokens_own_update(token_slots: list[int]) -> None:
    """All code paths of LoRALinear.add_delta against the per-token definition y + s x A^T B^T."""
    from kvpilot.runtime.lora.layers import LoRAContext, LoRALinear, SubTarget

    g = torch.Generator().manual_seed(3)
    fan_in, fan_out, ranks, scaling = 12, 10, [2, 4, 3, 4], 0.5
    ctx = LoRAContext()
    layer = LoRALinear(
        {"q_proj": SubTarget(0, 0, fan_out, 0, 0, fan_in)},
        fan_in,
        fan_out,
        4,
        4,
        ctx,
        torch.device("cpu"),
        torch.float32,
    )
    weights = []
    for slot, r in enumerate(ranks):
        a, b = torch.randn(r, fan_in, generator=g), torch.randn(fan_out, r, generator=g)
        layer.set_slot(slot, {"q_proj": (a, b)}, scaling)
        weights.append((a, b))
    x = torch.randn(len(token_slots), fan_in, generator=g)
    base = torch.randn(len(token_slots), fan_out, generator=g)
    ctx.batch = build_lora_batch(token_slots, ranks, torch.device("cpu"), torch.float32)
    got = layer.add_delta(x, base.clone())
    want = base.clone()
    for t, slot in enumerate(token_slots):
        if slot >= 0:
            a, b = weights[slot]
            want[t] += scaling * (x[t] @ a.t() @ b.t())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
