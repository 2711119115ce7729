"""How faithful each precision path is to float32, on the builtin model, in one run.

For every configuration (kvpilot in a dtype at a CPU kernel level, transformers in a dtype) it
measures, on tests/runtime/quality.py's public-domain text and chat questions:
- teacher-forced next-token agreement with float32 (kvpilot's own and transformers'),
- greedy chat answers (24 tokens) identical to the float32 ones.
Each configuration runs in its own process, because the kernel level is chosen at import from the
environment (KVPILOT_CPU_ISA, KVPILOT_DISABLE_CPU_KERNEL). Prints one JSON document with the CPU.

    python benchmarks/runtime_quality.py dtype                 # every level this CPU has
    python benchmarks/runtime_quality.py dtype --configs kvpilot:auto kvpilot:auto@avx2 hf:bfloat16
    python benchmarks/runtime_quality.py dtype --configs kvpilot:auto+quantization=auto \
        kvpilot:auto+quantization=auto+qmatmul=float kvpilot:auto+quantization=none hf:bfloat16

A kvpilot configuration may set engine options after the dtype: `+quantization=none|auto|int8|int4`
(none: the checkpoint dequantized at load), `+qmatmul=int8|int16|bf16|float` (--qmatmul-activations) and
`+kv=auto|float32|bfloat16|int8|fp8` (--kv-cache-dtype). The reference is float32 throughout: the
dequantized weights, float32 activations and a float32 KV cache.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import harness  # noqa: E402

from kvpilot.runtime.engine.build import build_engine  # noqa: E402
from tests.runtime.quality import ANSWER_TOKENS, QUESTIONS, TEXT, agreement, same_answers  # noqa: E402

# configuration name -> (engine, dtype, environment)
# (an AVX2-only CPU as scripts/test.sh emulates one: our kernels and torch's ATen, oneDNN, MKL capped)
AVX2_CPU = {
    "KVPILOT_CPU_ISA": "avx2",
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}
LEVEL_ENV = {
    "": {},
    "avx512": {"KVPILOT_CPU_ISA": "avx512"},
    "avx2": AVX2_CPU,
    "generic": {"KVPILOT_CPU_ISA": "generic"},
    "torch": {"KVPILOT_DISABLE_CPU_KERNEL": "1"},
}


OPTIONS = {
    "quantization": ("none", "auto", "int8", "int4"),
    "qmatmul": ("int8", "int16", "bf16", "float"),
    "kv": ("auto", "float32", "bfloat16", "int8", "fp8"),
}


def parse_config(name: str) -> tuple[str, str, dict[str, str]]:
    """'kvpilot:auto@avx2' -> ('kvpilot', 'auto', {'KVPILOT_CPU_ISA': 'avx2'})."""
    engine, _, rest = name.partition(":")
    spec, _, level = rest.partition("@")
    dtype, *_ = spec.split("+")
    if engine not in ("kvpilot", "hf") or not dtype or level not in LEVEL_ENV:
        raise SystemExit(
            f"--configs: bad configuration {name!r} (engine:dtype[+option=value...][@avx2|generic|torch])"
        )
    engine_options(name)  # refuse bad options before any process starts
    return engine, dtype, LEVEL_ENV[level]


def engine_options(name: str) -> dict[str, str]:
    """'kvpilot:auto+quantization=auto+qmatmul=float@avx2' -> {'quantization': 'auto', 'qmatmul': 'float'}."""
    engine, _, rest = name.partition(":")
    _, *pairs = rest.partition("@")[0].split("+")
    options: dict[str, str] = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        if engine != "kvpilot" or value not in OPTIONS.get(key, ()):
            raise SystemExit(
                f"--configs: bad option {pair!r} in {name!r} (kvpilot only: "
                + ", ".join(f"{k}={'|'.join(v)}" for k, v in OPTIONS.items())
                + ")"
            )
        options[key] = value
    return options


def run_kvpilot(dtype: str, options: dict[str, str], model: str | None = None) -> dict[str, Any]:
    import torch

    from kvpilot.runtime.config import EngineConfig
    from kvpilot.runtime.engine.sampling_params import SamplingParams

    settings: dict[str, Any] = {"dtype": dtype, "kv_cache_memory": 256 * 2**20}
    if model is not None:
        settings["model"] = model
    if "quantization" in options:
        settings["quantization"] = options["quantization"]
    if "qmatmul" in options:
        settings["qmatmul_activations"] = options["qmatmul"]
    if "kv" in options:
        settings["kv_cache_dtype"] = options["kv"]
    engine = build_engine(EngineConfig(**settings))
    tok = engine.tokenizer
    ids = tok.encode(TEXT, add_special_tokens=False)
    choices = engine.next_token_choices(ids)
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
        for q in QUESTIONS
    ]
    params = SamplingParams(temperature=0.0, max_tokens=ANSWER_TOKENS)
    answers = [s.output_token_ids for s in engine.generate(prompts, params)]
    texts = [tok.decode(a) for a in answers]
    return {
        **(speed(engine, ids) if os.environ.get("KVPILOT_BENCH_SPEED") == "1" else {}),
        "dtype": embedding_dtype(engine),
        "quantization": engine.cfg.quantization,
        "qmatmul_activations": engine.cfg.qmatmul_activations,
        "kv_storage": str(engine.runner.geometry.dtype).removeprefix("torch."),
        "text_ids": ids,
        "choices": choices,
        "answers": answers,
        "answer_text": texts,
        "torch_threads": torch.get_num_threads(),
    }


def embedding_dtype(engine: Any) -> str:
    """The embedding's dtype (the model dtype), or 'quantized' when it is kept in quantized blocks."""
    weight = engine.runner.model.model.embed_tokens.weight
    return "quantized" if weight is None else str(weight.dtype).removeprefix("torch.")


def speed(engine: Any, ids: list[int]) -> dict[str, float]:
    """Decode tok/s at one stream and at 32 (64-token prompts from the text, 64 new tokens each)."""
    import time

    from kvpilot.runtime.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    engine.generate([ids[:64]], SamplingParams(temperature=0.0, max_tokens=8))  # warm-up
    out: dict[str, float] = {}
    for name, prompts in (
        ("single_tok_s", [ids[:64]]),
        ("batch32_tok_s", [ids[i : i + 64] for i in range(32)]),
    ):
        start = time.perf_counter()
        engine.generate(prompts, params)
        out[name] = round(len(prompts) * 64 / (time.perf_counter() - start), 1)
    return out


def run_hf(dtype: str, text_ids: list[int], prompts: list[list[int]], eos: list[int]) -> dict[str, Any]:
    import torch
    import transformers

    from kvpilot.runtime.config import DEFAULT_MODEL
    from kvpilot.runtime.load.loader import resolve_model_path

    path = resolve_model_path(DEFAULT_MODEL)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=getattr(torch, dtype)
    ).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([text_ids])).logits[0, :-1]
        choices = logits.argmax(-1).tolist()
        answers = []
        for p in prompts:
            out = model.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                do_sample=False,
                max_new_tokens=ANSWER_TOKENS,
                eos_token_id=eos,
                pad_token_id=eos[0],
            )
            answers.append(out[0, len(p) :].tolist())
    return {"dtype": dtype, "choices": choices, "answers": answers}


def worker(args: argparse.Namespace) -> None:
    engine, dtype, _ = parse_config(args.worker)
    if engine == "kvpilot":
        out = run_kvpilot(dtype, engine_options(args.worker), args.model)
    else:
        ref = json.loads(Path(args.inputs).read_text())
        out = run_hf(dtype, ref["text_ids"], ref["prompts"], ref["eos"])
    Path(args.out).write_text(json.dumps(out))


def spawn(name: str, out: Path, inputs: Path | None = None, model: Path | None = None) -> dict[str, Any]:
    """Run one configuration in its own process (its kernel level is read at import); `model`: a
    model file instead of the builtin one (kvpilot configurations only)."""
    _, _, env = parse_config(name)
    cmd = [sys.executable, __file__, "--worker", name, "--out", str(out)]
    if inputs is not None:
        cmd += ["--inputs", str(inputs)]
    if model is not None:
        cmd += ["--model", str(model)]
    subprocess.run(cmd, check=True, env={**os.environ, **env}, timeout=1800)
    return json.loads(out.read_text())


def chat_prompts() -> tuple[list[list[int]], list[int]]:
    from kvpilot.runtime.config import DEFAULT_MODEL
    from kvpilot.runtime.load.loader import resolve_model_path
    from kvpilot.runtime.load.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(resolve_model_path(DEFAULT_MODEL))
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
        for q in QUESTIONS
    ]
    return prompts, sorted(tok.eos_token_ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="*", help="engine:dtype[@level]; default: every level here")
    ap.add_argument("--workdir", default="/tmp/kvpilot-dtype-quality")
    ap.add_argument("--speed", action="store_true", help="also time kvpilot's decode (1 and 32 streams)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--inputs", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    if args.speed:
        os.environ["KVPILOT_BENCH_SPEED"] = "1"
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    configs = args.configs or [
        "kvpilot:auto",
        "kvpilot:auto@avx2",
        "kvpilot:auto@torch",
        "kvpilot:bfloat16",
        "hf:bfloat16",
    ]
    # the dequantized float32 model: with --quantization unset a GGUF takes the default path, whose
    # activations may be rounded to bfloat16 (runtime/load/defaults.py), not a reference
    ref = spawn("kvpilot:float32+quantization=none+kv=float32", work / "kvpilot-float32.json")
    prompts, eos = chat_prompts()
    inputs = work / "inputs.json"
    inputs.write_text(json.dumps({"text_ids": ref["text_ids"], "prompts": prompts, "eos": eos}))
    hf32 = spawn("hf:float32", work / "hf-float32.json", inputs)
    rows: dict[str, Any] = {}
    for name in configs:
        res = spawn(name, work / f"{re.sub('[^A-Za-z0-9_.-]', '-', name)}.json", inputs)
        rows[name] = {
            "dtype": res["dtype"],
            "teacher_forced_vs_kvpilot_fp32": round(agreement(res["choices"], ref["choices"]), 4),
            "teacher_forced_vs_hf_fp32": round(agreement(res["choices"], hf32["choices"]), 4),
            "answers_as_kvpilot_fp32": same_answers(res["answers"], ref["answers"]),
            "answers_as_hf_fp32": same_answers(res["answers"], hf32["answers"]),
            "answer_text": res.get("answer_text", [])[:3],
            **{k: res[k] for k in ("single_tok_s", "batch32_tok_s") if k in res},
        }
    doc = {
        "cpu": platform.processor() or platform.machine(),
        "lscpu_model": harness.cpu_model(),
        "text_tokens": len(ref["text_ids"]),
        "questions": len(QUESTIONS),
        "kvpilot_fp32_vs_hf_fp32": {
            "teacher_forced": round(agreement(ref["choices"], hf32["choices"]), 4),
            "answers": same_answers(ref["answers"], hf32["answers"]),
        },
        "configs": rows,
    }
    print(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
