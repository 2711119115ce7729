"""Speculative decoding on SmolLM2: single-stream speed-up and the throughput cost under load.

Single stream (one request at a time, greedy, exactly --max-tokens output tokens each): for every
"repeat this text" prompt (a chat turn asking the model to repeat a passage of real English text, so
the answer quotes the prompt), decode tokens/s without speculation, with n-gram speculation and with
a draft model (a tiny random-weight draft with SmolLM2's tokenizer built by the script: it shows
the cost of a draft with ~no acceptance, since no smaller model shares SmolLM2's tokenizer here).

Batches of B requests (B = --batch-sizes), all submitted at once: output tokens/s without
speculation, with n-gram speculation always on (K = --k) and with the adaptive rule, on the quoting
prompts and on plain continuation prompts (text from the same corpus, where n-gram matches are rare
and mostly wrong).

    python benchmarks/runtime_features.py speculative --output benchmarks/results/spec.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import workload as wl
from peers.measure import machine_info

from kvpilot.runtime.config import DEFAULT_MODEL, EngineConfig
from kvpilot.runtime.engine.build import engine_from_loaded
from kvpilot.runtime.engine.core import LLMEngine
from kvpilot.runtime.engine.sampling_params import SamplingParams
from kvpilot.runtime.load.loader import LoadedModel, load_model, resolve_dtype
from kvpilot.runtime.load.tokenizer import Tokenizer


def log(msg: str) -> None:
    print(f"[spec-bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def passages(n: int, words: int, seed: int = 0) -> list[str]:
    """n passages of about `words` words of real English text (standard-library docstrings)."""
    text = " ".join(wl.corpus_text().split())
    tokens = text.split(" ")
    step = max(1, (len(tokens) - words) // max(1, n))
    return [" ".join(tokens[i * step + seed : i * step + seed + words]) for i in range(n)]


def quoting_prompts(tok: Tokenizer, n: int, words: int) -> list[list[int]]:
    """n chat turns asking the model to repeat ~`words` words of text (the answer quotes the prompt).
    runtime_vs_peers.py's --single-text quoting runs every engine on these prompts."""
    out = []
    for text in passages(n, words):
        chat = tok.apply_chat_template(
            [{"role": "user", "content": f"Repeat this text exactly, word for word:\n\n{text}"}],
            add_generation_prompt=True,
        )
        out.append(tok.encode(chat, add_special_tokens=False))
    return out


def continuation_prompts(loaded: LoadedModel, n: int, words: int) -> list[list[int]]:
    return [loaded.tokenizer.encode(t) for t in passages(n, words, seed=7)]


def write_random_draft(directory: Path, target: LoadedModel, layers: int, hidden: int) -> None:
    import transformers as tf

    cfg = tf.LlamaConfig(
        vocab_size=int(target.arch.vocab_size),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 64),
        head_dim=64,
        max_position_embeddings=target.max_model_len,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(directory)
    target.tokenizer.backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"})
    )


def engine(
    loaded: LoadedModel, args: argparse.Namespace, draft: LoadedModel | None, **spec: Any
) -> LLMEngine:
    cfg = EngineConfig(
        dtype=args.dtype,
        kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=max(args.batch_sizes),
        **spec,
    )
    return engine_from_loaded(loaded, cfg, draft=draft)


def single_stream(eng: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """Decode tok/s over all prompts: tokens after each request's first step / the time they took."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    decode_tokens = 0
    decode_s = 0.0
    per_prompt = []
    s0 = eng.stats()
    outputs = []
    for i, p in enumerate(prompts):
        rid = f"single-{i}-{time.monotonic_ns()}"
        eng.add_request(rid, p, params)
        seq = eng.requests[rid].seq
        first: float | None = None
        n_first = 0
        while eng.has_unfinished():
            eng.step()
            if first is None and seq.num_output_tokens > 0:
                first, n_first = time.perf_counter(), seq.num_output_tokens
        end = time.perf_counter()
        assert first is not None
        n = seq.num_output_tokens - n_first
        decode_tokens += n
        decode_s += end - first
        per_prompt.append(round(n / (end - first), 1))
        outputs.append(seq.output_token_ids)
    s1 = eng.stats()
    out: dict[str, Any] = {
        "decode_tok_per_s": round(decode_tokens / decode_s, 1),
        "per_prompt_tok_per_s": per_prompt,
        "steps": s1.num_steps - s0.num_steps,
        "output_tokens": sum(len(o) for o in outputs),
    }
    out.update(spec_figures(s0, s1))
    out["_outputs"] = outputs
    return out


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (None when identical)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def spec_figures(s0: Any, s1: Any) -> dict[str, Any]:
    if s1.spec_num_draft_tokens is None:
        return {}
    proposed = s1.spec_num_draft_tokens - s0.spec_num_draft_tokens
    accepted = s1.spec_num_accepted_tokens - s0.spec_num_accepted_tokens
    drafts = s1.spec_num_drafts - s0.spec_num_drafts
    return {
        "proposed_tokens": proposed,
        "accepted_tokens": accepted,
        "acceptance_rate": round(accepted / proposed, 3) if proposed else None,
        "mean_tokens_per_verification": round((accepted + drafts) / drafts, 2) if drafts else None,
    }


def batch_run(eng: LLMEngine, prompts: list[list[int]], batch: int, max_tokens: int) -> dict[str, Any]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    reqs = [prompts[i % len(prompts)] for i in range(batch)]
    eng.block_manager.reset_prefix_cache()
    s0 = eng.stats()
    t0 = time.perf_counter()
    seqs = eng.generate(reqs, params)
    dt = time.perf_counter() - t0
    s1 = eng.stats()
    out: dict[str, Any] = {
        "output_tok_per_s": round(sum(s.num_output_tokens for s in seqs) / dt, 1),
        "seconds": round(dt, 2),
        "steps": s1.num_steps - s0.num_steps,
    }
    out.update(spec_figures(s0, s1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--k", type=int, default=4, help="--num-speculative-tokens")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--words", type=int, default=90, help="words per passage to repeat")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    ap.add_argument("--batch-max-tokens", type=int, default=48)
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--draft-hidden", type=int, default=128)
    ap.add_argument("--kv-cache-memory", type=int, default=512 << 20)
    ap.add_argument("--skip-batches", action="store_true")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds; the best is reported")
    ap.add_argument(
        "--configs",
        type=lambda s: s.split(","),
        default=["plain", "ngram", "ngram_adaptive", "draft_random", "draft_random_adaptive"],
    )
    ap.add_argument("--output")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    dtype = resolve_dtype(args.dtype, device)
    record: dict[str, Any] = {
        "machine": machine_info(),
        "threads": args.threads,
        "dtype": str(dtype),
        "k": args.k,
        "command": " ".join(sys.argv),
    }
    log(f"loading SmolLM2 ({dtype})")
    loaded = load_model(EngineConfig(model=DEFAULT_MODEL), device, dtype)
    quoting = quoting_prompts(loaded.tokenizer, args.prompts, args.words)
    plain_text = continuation_prompts(loaded, args.prompts, args.words)
    record["quoting_prompt_tokens"] = [len(p) for p in quoting]

    with tempfile.TemporaryDirectory() as tmp:
        write_random_draft(Path(tmp), loaded, args.draft_layers, args.draft_hidden)
        draft = load_model(EngineConfig(model=tmp), device, dtype)

        ngram = {"speculative_method": "ngram", "num_speculative_tokens": args.k}
        drafted = {"speculative_method": "draft", "num_speculative_tokens": args.k, "speculative_model": tmp}
        configs: dict[str, dict[str, Any]] = {
            "plain": {},
            "ngram": {**ngram, "speculative_adaptive": False},
            "ngram_adaptive": ngram,
            "draft_random": {**drafted, "speculative_adaptive": False},
            "draft_random_adaptive": drafted,
        }
        names = [n for n in configs if n in args.configs]
        engines = {n: engine(loaded, args, draft if "draft" in n else None, **configs[n]) for n in names}
        for eng in engines.values():  # warm up
            eng.generate([quoting[0][:32]], SamplingParams(temperature=0.0, max_tokens=4))
        # rounds alternate the configurations, so a load change on a shared machine hits them all;
        # each configuration's best round is reported
        single: dict[str, Any] = {}
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else reversed(names):
                log(f"round {r}: single stream {name}")
                fig = single_stream(engines[name], quoting, args.max_tokens)
                fig["rounds_tok_per_s"] = [
                    *single.get(name, {}).get("rounds_tok_per_s", []),
                    fig["decode_tok_per_s"],
                ]
                if name not in single or fig["decode_tok_per_s"] > single[name]["decode_tok_per_s"]:
                    single[name] = fig
                else:
                    single[name]["rounds_tok_per_s"] = fig["rounds_tok_per_s"]
        want = single["plain"].pop("_outputs") if "plain" in single else None
        for name, fig in single.items():
            if name != "plain":
                got = fig.pop("_outputs")
                fig["outputs_identical_to_plain"] = got == want
                if want is not None:
                    fig["first_divergence_per_prompt"] = [
                        first_divergence(a, b) for a, b in zip(got, want, strict=True)
                    ]
        if "plain" in single:
            base = single["plain"]["decode_tok_per_s"]
            for fig in single.values():
                fig["speedup_vs_plain"] = round(fig["decode_tok_per_s"] / base, 2)
        record["single_stream_quoting"] = single
        log(json.dumps({k: v["decode_tok_per_s"] for k, v in single.items()}))

    if not args.skip_batches:
        batches: dict[str, Any] = {}
        names = [n for n in ("plain", "ngram", "ngram_adaptive") if n in args.configs]
        engines = {n: engine(loaded, args, None, **configs[n]) for n in names}
        for wname, prompts in (("quoting", quoting), ("continuation", plain_text)):
            for b in args.batch_sizes:
                row: dict[str, Any] = {}
                for r in range(args.rounds):
                    for name in names if r % 2 == 0 else reversed(names):
                        log(f"round {r}: batch {b}: {wname} / {name}")
                        fig = batch_run(engines[name], prompts, b, args.batch_max_tokens)
                        if name not in row or fig["output_tok_per_s"] > row[name]["output_tok_per_s"]:
                            row[name] = fig
                if "plain" in row:
                    base = row["plain"]["output_tok_per_s"]
                    for fig in row.values():
                        fig["vs_plain"] = round(fig["output_tok_per_s"] / base, 2)
                batches.setdefault(wname, {})[f"batch_{b}"] = row
        record["batches"] = batches

    text = json.dumps(record, indent=2)
    print(text)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text + "\n")


if __name__ == "__main__":
    main()
