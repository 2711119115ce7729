"""lm-eval against `kvpilot serve` and against transformers, on the same local task.

Runs `lm_eval --model local-completions` (echo + logprobs on /v1/completions: the prompt
log-probabilities) against a real `kvpilot serve` of the builtin SmolLM2 GGUF in float32, and
`lm_eval --model hf` on transformers' model from the same GGUF file in float32 (transformers
dequantizes it: the same weights, so the honest reference), on benchmarks/lm_eval/kvpilot_facts.yaml
(50 multiple-choice questions in benchmarks/lm_eval/data/; nothing is downloaded). Prints JSON with
both accuracies, the commands and the machine.

lm-eval pins packages this project's environment does not (python-dateutil), so it may live in its own
virtual environment: pass its `lm_eval` with --lm-eval; that environment needs torch, transformers,
accelerate and gguf for the hf reference.

    python benchmarks/lm_eval_bench.py --lm-eval /path/to/venv/bin/lm_eval
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import machine, write_json

ROOT = Path(__file__).resolve().parents[1]
TASK = "kvpilot_facts"
TASK_DIR = "benchmarks/lm_eval"
SERVED = "smollm2"


def export_tokenizer(gguf: Path, out: Path) -> None:
    """transformers' tokenizer of the GGUF file, saved where local-completions can load it by path."""
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(out))


def start_serve(port: int, threads: int) -> subprocess.Popen[bytes]:
    argv = [
        sys.executable, "-m", "kvpilot", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--device", "cpu", "--threads", str(threads), "--served-model-name", SERVED,
    ]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.monotonic()
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
        if proc.poll() is not None or time.monotonic() - t0 > 300:
            proc.kill()
            raise RuntimeError("kvpilot serve did not become ready in 300 s")


def run_lm_eval(lm_eval: str, model: str, model_args: str, out: Path, timeout: float) -> dict[str, Any]:
    """One lm_eval run of the task; returns the command and the task's metrics."""
    cmd = [
        lm_eval, "--model", model, "--model_args", model_args, "--tasks", TASK, "--device", "cpu",
        "--include_path", TASK_DIR, "--batch_size", "1", "--output_path", str(out),
    ]  # fmt: skip
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    # its tables and progress go to stderr: stdout is this script's JSON
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, timeout=timeout, stdout=sys.stderr)
    (path,) = glob.glob(str(out / "**" / "results_*.json"), recursive=True)
    results = json.loads(Path(path).read_text())["results"][TASK]
    metrics = {k.split(",")[0]: v for k, v in results.items() if k.startswith(("acc,", "acc_norm,"))}
    return {"command": " ".join(cmd), **metrics}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lm-eval", default="lm_eval", help="the lm_eval executable")
    parser.add_argument("--threads", type=int, default=2, help="kvpilot serve --threads")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per lm_eval run")
    parser.add_argument("--json-out", help="also write the JSON here")
    args = parser.parse_args()

    from kvpilot.net import free_port
    from kvpilot.runtime.config import DEFAULT_MODEL
    from kvpilot.runtime.load.loader import resolve_model_path

    gguf = resolve_model_path(DEFAULT_MODEL)
    with tempfile.TemporaryDirectory() as tmp:
        tok = Path(tmp) / "tokenizer"
        export_tokenizer(gguf, tok)
        port = free_port()
        proc = start_serve(port, args.threads)
        try:
            ours = run_lm_eval(
                args.lm_eval,
                "local-completions",
                f"model={SERVED},base_url=http://127.0.0.1:{port}/v1/completions,tokenizer_backend=huggingface,"
                f"tokenizer={tok},num_concurrent=1,max_retries=1,timeout=120",
                Path(tmp) / "kvpilot",
                args.timeout,
            )
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        ref = run_lm_eval(
            args.lm_eval,
            "hf",
            f"pretrained={gguf.parent},gguf_file={gguf.name},dtype=float32",
            Path(tmp) / "hf",
            args.timeout,
        )
    n = sum(1 for _ in (ROOT / TASK_DIR / "data" / "facts.jsonl").open())
    doc = {
        "task": TASK,
        "items": n,
        "model": f"{gguf.name} (float32)",
        "kvpilot_local_completions": ours,
        "transformers_hf": ref,
        "acc_difference_items": round(abs(ours["acc"] - ref["acc"]) * n, 3),
        "machine": machine(),
    }
    print(json.dumps(doc, indent=2))
    write_json(doc, args.json_out)


if __name__ == "__main__":
    main()
