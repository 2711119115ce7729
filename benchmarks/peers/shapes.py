#!/usr/bin/env python
"""Random-weight checkpoints at the shapes users serve (`runtime_vs_peers.py shapes`), so the
runtime-vs-peers comparison runs at 1B-8B and not only on the 135M SmolLM2 GGUF.

A shape (SHAPES: `llama-1b` is Llama-3.2-1B's, `llama-3b` Llama-3.2-3B's, `llama-8b` Llama-3.1-8B's) becomes, under
benchmarks/.build/shapes/<name>/ (gitignored; reused when present):

    hf/          a Hugging Face directory: config.json, model.safetensors (bfloat16, normal(0, 0.02)
                 from torch with a fixed seed, RMSNorm weights ones; shards of <= 4 GiB with an
                 index above 4 GiB) and SmolLM2's tokenizer (tokenizer.json, tokenizer_config.json,
                 written by transformers from the GGUF the repo uses, benchmarks/workload.py). The
                 config's vocab_size is the shape's (128256): llama.cpp's converter pads the 49152
                 tokens of SmolLM2 with UNUSED "[PAD<i>]" tokens up to it, so every prompt id of the
                 workload (SmolLM2's tokenizer) is valid and the embedding and LM head have real size.
    <name>-bf16.gguf, <name>-q8_0.gguf   llama.cpp's own converter (convert_hf_to_gguf.py from the
                 llama-cpp-python sdist that build_llamacpp.sh unpacks; its vendored gguf-py first on
                 PYTHONPATH), --outtype bf16 / q8_0
    <name>-q4_k_m.gguf   `llama-quantize <bf16> Q4_K_M` (build_llamacpp.sh --target llama-quantize)

The tokenizer passes the converter's pre-tokenizer check as is: its hash of the check text is the one
the converter knows as "smollm" (855059429035...), so tokenizer.ggml.pre = "smollm".
Not copied from the real models: rope scaling (Llama 3's "llama3" rope_scaling is left out; plain
RoPE at rope_theta 500000) and max_position_embeddings (32768, not 131072): neither changes the bytes
or FLOPs of a step. Random weights make the output text meaningless; speed does not depend on it
(ignore_eos fixes the lengths).

    python benchmarks/runtime_vs_peers.py shapes --model llama-1b               # all three files
    python benchmarks/runtime_vs_peers.py shapes --model llama-8b --formats q4_k_m
    python benchmarks/runtime_vs_peers.py --model llama-1b:q4_k_m ...   # the comparison on one of them
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]  # benchmarks/
BUILD_DIR = HERE / ".build"
SHAPES_DIR = BUILD_DIR / "shapes"
LLAMACPP_VERSION = "0.3.36"  # engine_llamacpp.DEFAULT_LLAMACPP_VERSION (not imported: no kvpilot here)
FORMATS = ("bf16", "q8_0", "q4_k_m")
SEED = 0
STD = 0.02
SHARD_BYTES = 4 * 2**30
# llama.cpp's requirements-convert_legacy_llama.txt
CONVERTER_SENTENCEPIECE = "sentencepiece>=0.1.98,<0.3.0"


@dataclass(frozen=True)
class Shape:
    """A decoder-only Llama's dimensions (what config.json says)."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    rope_theta: float = 500000.0
    rms_eps: float = 1e-5
    max_positions: int = 32768

    def tensors(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every tensor of the Hugging Face checkpoint, in file order."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        yield "model.embed_tokens.weight", (self.vocab, self.hidden)
        for i in range(self.layers):
            p = f"model.layers.{i}."
            yield p + "input_layernorm.weight", (self.hidden,)
            yield p + "self_attn.q_proj.weight", (q, self.hidden)
            yield p + "self_attn.k_proj.weight", (kv, self.hidden)
            yield p + "self_attn.v_proj.weight", (kv, self.hidden)
            yield p + "self_attn.o_proj.weight", (self.hidden, q)
            yield p + "post_attention_layernorm.weight", (self.hidden,)
            yield p + "mlp.gate_proj.weight", (self.intermediate, self.hidden)
            yield p + "mlp.up_proj.weight", (self.intermediate, self.hidden)
            yield p + "mlp.down_proj.weight", (self.hidden, self.intermediate)
        yield "model.norm.weight", (self.hidden,)
        if not self.tied:
            yield "lm_head.weight", (self.vocab, self.hidden)

    @property
    def params(self) -> int:
        total = 0
        for _, dims in self.tensors():
            n = 1
            for d in dims:
                n *= d
            total += n
        return total

    @property
    def layer_linear_params(self) -> int:
        """Weights of the matmuls of all decoder layers (what every token fed multiplies)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        per_layer = self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.intermediate
        return self.layers * per_layer


SHAPES: dict[str, Shape] = {
    # Llama-3.2-1B: tied embeddings
    "llama-1b": Shape("llama-1b", 2048, 8192, 16, 32, 8, 64, 128256, tied=True),
    # Llama-3.2-3B: tied embeddings, head_dim 128 (the 8B's heads at a size a 2-core machine runs)
    "llama-3b": Shape("llama-3b", 3072, 8192, 28, 24, 8, 128, 128256, tied=True),
    # Llama-3.1-8B: untied LM head
    "llama-8b": Shape("llama-8b", 4096, 14336, 32, 32, 8, 128, 128256, tied=False),
}


def hf_config(shape: Shape, bos_token_id: int, eos_token_id: int) -> dict[str, object]:
    """Pure: config.json of the checkpoint."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "vocab_size": shape.vocab,
        "tie_word_embeddings": shape.tied,
        "rope_theta": shape.rope_theta,
        "rms_norm_eps": shape.rms_eps,
        "max_position_embeddings": shape.max_positions,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": "bfloat16",
    }


def shard_plan(shape: Shape, shard_bytes: int = SHARD_BYTES, elem_bytes: int = 2) -> list[list[str]]:
    """Pure: the tensor names of each safetensors file, in order, each file at most `shard_bytes`
    (a tensor larger than that gets a file of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, dims in shape.tensors():
        n = elem_bytes
        for d in dims:
            n *= d
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def shard_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def log(msg: str) -> None:
    print(f"[shapes {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def write_tokenizer(directory: Path) -> tuple[int, int]:
    """SmolLM2's tokenizer (from the repo's GGUF) saved as tokenizer.json + tokenizer_config.json;
    returns its (bos, eos) ids."""
    import workload as wl
    from transformers import AutoTokenizer

    gguf = wl.smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.save_pretrained(str(directory))
    return int(tok.bos_token_id), int(tok.eos_token_id)


def write_hf_checkpoint(
    shape: Shape, directory: Path, seed: int = SEED, shard_bytes: int = SHARD_BYTES
) -> None:
    """The Hugging Face directory of `shape` (module docstring); written to a temporary folder first."""
    import torch
    from safetensors.torch import save_file

    tmp = directory.with_name(directory.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    bos, eos = write_tokenizer(tmp)
    (tmp / "config.json").write_text(json.dumps(hf_config(shape, bos, eos), indent=2) + "\n")
    dims = dict(shape.tensors())
    gen = torch.Generator().manual_seed(seed)
    plan = shard_plan(shape, shard_bytes)
    files = shard_names(len(plan))
    weight_map: dict[str, str] = {}
    for names, fname in zip(plan, files, strict=True):
        tensors = {}
        for name in names:
            t = torch.empty(dims[name], dtype=torch.bfloat16)
            if name.endswith("norm.weight"):
                t.fill_(1.0)
            else:
                t.normal_(0.0, STD, generator=gen)
            tensors[name] = t
            weight_map[name] = fname
        log(f"{shape.name}: writing {fname} ({len(names)} tensors)")
        save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
        del tensors
    if len(files) > 1:
        index = {"metadata": {"total_size": 2 * shape.params}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    tmp.rename(directory)


def llamacpp_source(version: str = LLAMACPP_VERSION) -> Path:
    """llama.cpp's sources as build_llamacpp.sh unpacks them (LLAMACPP_BUILD_DIR as there)."""
    build = Path(os.environ.get("LLAMACPP_BUILD_DIR", BUILD_DIR))
    return build / "src" / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"


def llamacpp_tool(name: str, version: str = LLAMACPP_VERSION) -> Path:
    """A binary of build_llamacpp.sh's native build; builds it (--target) when missing."""
    build = Path(os.environ.get("LLAMACPP_BUILD_DIR", BUILD_DIR))
    path = build / f"llama.cpp-{version}" / "bin" / name
    if not path.exists():
        log(f"building {name} (benchmarks/build_llamacpp.sh --target {name}) ...")
        subprocess.run(
            ["bash", str(HERE / "build_llamacpp.sh"), "--target", name, version],
            check=True,
            stdout=sys.stderr,
        )
    return path


def ensure_source(version: str = LLAMACPP_VERSION) -> Path:
    src = llamacpp_source(version)
    if not (src / "convert_hf_to_gguf.py").exists():
        # build_llamacpp.sh downloads and unpacks the sdist before it builds; the quantize tool is small
        llamacpp_tool("llama-quantize", version)
    return src


def converter_deps() -> Path:
    """A folder with sentencepiece (the converter's own requirement) for the converter's PYTHONPATH.

    LlamaModel.set_vocab imports sentencepiece before it looks for a tokenizer.model, so without
    the package the conversion fails (ModuleNotFoundError) even for a tokenizer.json vocabulary;
    installed here, not in the project's environment, because only the converter needs it."""
    deps = BUILD_DIR / "convert-deps"
    if not (deps / "sentencepiece").exists():
        log(f"installing sentencepiece for the converter into {deps}")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--target",
                str(deps),
                "--no-deps",
                CONVERTER_SENTENCEPIECE,
            ],
            check=True,
            stdout=sys.stderr,
        )
    return deps


def convert(hf_dir: Path, out: Path, outtype: str, version: str = LLAMACPP_VERSION) -> None:
    """llama.cpp's convert_hf_to_gguf.py on `hf_dir` (its own gguf-py first on the path)."""
    src = ensure_source(version)
    env = dict(os.environ)
    path = [str(src / "gguf-py"), str(converter_deps()), env.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, path))
    tmp = out.with_name(out.name + ".partial")
    argv = [sys.executable, str(src / "convert_hf_to_gguf.py"), str(hf_dir), "--outtype", outtype]
    log(f"converting: {' '.join(argv[1:])} --outfile {tmp.name}")
    subprocess.run([*argv, "--outfile", str(tmp)], check=True, env=env, stdout=sys.stderr)
    tmp.rename(out)


def quantize(source: Path, out: Path, ftype: str, version: str = LLAMACPP_VERSION) -> None:
    tool = llamacpp_tool("llama-quantize", version)
    tmp = out.with_name(out.name + ".partial")
    log(f"quantizing: {tool.name} {source.name} {tmp.name} {ftype}")
    subprocess.run([str(tool), str(source), str(tmp), ftype], check=True, stdout=sys.stderr)
    tmp.rename(out)


def gguf_path(name: str, fmt: str) -> Path:
    return SHAPES_DIR / name / f"{name}-{fmt}.gguf"


def hf_path(name: str) -> Path:
    """The shape's Hugging Face directory (bfloat16; what vLLM serves), built with its GGUFs."""
    return SHAPES_DIR / name / "hf"


def build(name: str, fmt: str) -> Path:
    """The GGUF of shape `name` in `fmt` (one of FORMATS), built (with what it needs) when missing."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r} (choose from {', '.join(SHAPES)})")
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r} (choose from {', '.join(FORMATS)})")
    out = gguf_path(name, fmt)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    hf_dir = hf_path(name)
    if fmt == "q4_k_m":
        quantize(build(name, "bf16"), out, "Q4_K_M")
        return out
    if not hf_dir.exists():
        write_hf_checkpoint(SHAPES[name], hf_dir)
    convert(hf_dir, out, fmt)
    return out


def parse_model(spec: str) -> tuple[str, str]:
    """`llama-1b:q4_k_m` -> ("llama-1b", "q4_k_m"); the format defaults to q4_k_m."""
    name, _, fmt = spec.partition(":")
    fmt = fmt or "q4_k_m"
    if name not in SHAPES or fmt not in FORMATS:
        raise ValueError(
            f"--model {spec!r}: expected SHAPE[:FORMAT] with SHAPE in {', '.join(SHAPES)} and FORMAT in "
            f"{', '.join(FORMATS)}, or a path to a .gguf file"
        )
    return name, fmt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-1b", choices=sorted(SHAPES))
    p.add_argument("--formats", default=",".join(FORMATS), help="comma list of " + ",".join(FORMATS))
    args = p.parse_args(argv)
    fmts = [f for f in args.formats.split(",") if f]
    bad = set(fmts) - set(FORMATS)
    if bad or not fmts:
        p.error(f"--formats takes some of {', '.join(FORMATS)}, not {args.formats!r}")
    shape = SHAPES[args.model]
    log(f"{shape.name}: {shape.params / 1e9:.2f}B parameters")
    for fmt in fmts:
        path = build(args.model, fmt)
        print(f"{fmt}\t{path}\t{path.stat().st_size / 2**30:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    raise SystemExit(main())
