"""benchmarks/runtime_vs_peers.py suite's plan (benchmarks/peers/suite.py: which runtime_vs_peers.py
process runs under which ISA settings) and its summary, runtime_vs_peers.py's single-stream
aggregation, and build_llamacpp.sh's --isa check."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import peers.suite as i14  # noqa: E402


def opt(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_plan_runs_single_streams_natively_and_batches_under_the_avx2_caps() -> None:
    args = i14.parse_args([])
    runs = i14.plan(args, "/bin/native", "/bin/avx2", "/tmp/draft")
    by_key = {r.key: r for r in runs}
    assert [r.key for r in runs if r.part == "single"] == [
        "single_peers",
        "single_none",
        "single_auto",
        "single_int8",
        "single_int4",
        "single_int4_ngram",
        "single_draft",
        "single_int4_python_layers",
    ]
    for r in runs:
        if r.key == "single_int4_python_layers":  # the decoder stack off: what it saves
            assert r.env == {"KVPILOT_CPU_DECODER_STACK": "0"}
        else:
            assert r.env == (i14.AVX2_ENV if r.part == "avx2_batch" else {})
        assert r.picks, r.key
    peers = by_key["single_peers"].argv
    assert opt(peers, "--engines") == "kvpilot,hf,llamacpp"
    assert opt(peers, "--llamacpp-bin") == "/bin/native"
    assert opt(peers, "--llamacpp-slots") == "1"
    # every single-stream run uses the same quoting prompts and lengths
    single_opts = {
        tuple(
            opt(r.argv, f) for f in ("--single-text", "--single-count", "--single-words", "--single-output")
        )
        for r in runs
        if r.part == "single"
    }
    assert single_opts == {("quoting", "3", "90", "64")}
    ngram = by_key["single_int4_ngram"].argv
    assert opt(ngram, "--kvpilot-quantization") == "int4"
    assert opt(ngram, "--kvpilot-speculative-method") == "ngram"
    draft = by_key["single_draft"].argv
    assert opt(draft, "--kvpilot-speculative-model") == "/tmp/draft"
    avx2 = by_key["avx2_peers"].argv
    assert opt(avx2, "--llamacpp-bin") == "/bin/avx2"
    assert opt(avx2, "--llamacpp-slots") == "32"
    assert opt(avx2, "--hf-dtype") == "auto"  # runtime_vs_peers.py probes fp32 and bf16, runs the faster
    assert "avx2_hf_bfloat16" not in by_key
    both = {r.key: r for r in i14.plan(i14.parse_args(["--hf-avx2-dtype", "both"]), None, None, None)}
    assert opt(both["avx2_peers"].argv, "--hf-dtype") == "float32"
    assert opt(both["avx2_hf_bfloat16"].argv, "--hf-dtype") == "bfloat16"
    assert both["avx2_hf_bfloat16"].env == i14.AVX2_ENV


def test_plan_leaves_llamacpp_out_without_a_binary_and_honours_parts() -> None:
    args = i14.parse_args(["--parts", "avx2_batch", "--smoke"])
    runs = i14.plan(args, None, None, None)
    assert {r.part for r in runs} == {"avx2_batch"}
    assert opt(runs[0].argv, "--engines") == "kvpilot,hf"
    assert "--llamacpp-bin" not in runs[0].argv
    with pytest.raises(SystemExit):
        i14.parse_args(["--parts", "single,gpu"])


def test_native_runs_drop_inherited_avx2_caps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPILOT_CPU_ISA", "avx2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    native = i14.child_env(i14.Run("a", "single", [], {}))
    assert not {"KVPILOT_CPU_ISA", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"} & set(native)
    capped = i14.child_env(i14.Run("b", "avx2_batch", [], dict(i14.AVX2_ENV)))
    assert all(capped[k] == v for k, v in i14.AVX2_ENV.items())


def test_the_avx512_part_runs_the_default_path_as_on_a_cpu_without_bf16_and_vnni(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    args = i14.parse_args(["--parts", "avx512_batch"])
    runs = i14.plan(args, "/bin/native", "/bin/avx2", None, avx512_bin="/bin/avx512")
    assert [r.key for r in runs] == ["avx512_peers"]
    run = runs[0]
    assert run.env == i14.AVX512_NO_BF16_ENV
    assert "avx512_bf16" in run.env["KVPILOT_CPU_HIDE_FEATURES"].split(",")
    assert "avx512_vnni" in run.env["KVPILOT_CPU_HIDE_FEATURES"].split(",")
    assert opt(run.argv, "--engines") == "kvpilot,llamacpp"
    assert opt(run.argv, "--llamacpp-bin") == "/bin/avx512"
    assert "--kvpilot-quantization" not in run.argv  # the default path, as such a CPU's users get it
    # without the binary, kvpilot alone; the emulations never leak into each other's runs
    assert opt(i14.plan(args, None, None, None)[0].argv, "--engines") == "kvpilot"
    monkeypatch.setenv("KVPILOT_CPU_HIDE_FEATURES", "avx512_bf16")
    monkeypatch.setenv("KVPILOT_CPU_ISA", "avx2")
    assert not {"KVPILOT_CPU_HIDE_FEATURES", "KVPILOT_CPU_ISA"} & set(
        i14.child_env(i14.Run("a", "single", [], {}))
    )
    avx2 = i14.child_env(i14.Run("b", "avx2_batch", [], dict(i14.AVX2_ENV)))
    assert "KVPILOT_CPU_HIDE_FEATURES" not in avx2 and avx2["KVPILOT_CPU_ISA"] == "avx2"
    skx = i14.child_env(run)
    assert "KVPILOT_CPU_ISA" not in skx and skx["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE"
    batch = lambda v: {"batch": {"output_tok_per_s": v}}  # noqa: E731
    s = i14.summarize(runs, {"avx512_peers": _doc({"kvpilot": batch(280.0), "llamacpp": batch(100.0)})})
    assert s["ratios"]["avx512_batch_vs_llamacpp"] == 2.8 and s["targets_met"]["avx512_batch_vs_llamacpp"]
    assert list(s["avx512_batch_output_tok_per_s"]) == [
        "kvpilot default",
        "llama.cpp server AVX-512 build (no VNNI/BF16), 32 slots",
    ]
    table = i14.markdown(s, "cpu")
    assert "AVX-512 without BF16/VNNI (emulated)" in table
    assert "single stream" not in table  # not among --parts: no empty table


def _doc(engines: dict[str, Any]) -> dict[str, Any]:
    return {"engines": engines}


def test_summary_ratios_use_the_fastest_transformers_dtype_and_the_best_kvpilot() -> None:
    args = i14.parse_args(["--smoke", "--hf-avx2-dtype", "both"])
    runs = i14.plan(args, "/n", "/a", "/d")
    single = lambda v: {"single_stream": {"decode_tok_per_s": v}}  # noqa: E731
    batch = lambda v: {"batch": {"output_tok_per_s": v}}  # noqa: E731
    docs: dict[str, dict[str, Any] | None] = {
        "single_peers": _doc({"kvpilot": single(20.0), "hf": single(10.0), "llamacpp": single(40.0)}),
        "single_int8": _doc({"kvpilot": single(30.0)}),
        "single_int4": _doc({"kvpilot": single(52.0)}),
        "single_int4_ngram": _doc({"kvpilot": single(80.0)}),
        "single_draft": None,  # a failed run leaves its row out
        "avx2_peers": _doc({"kvpilot": batch(150.0), "hf": batch(40.0), "llamacpp": batch(100.0)}),
        "avx2_int8": _doc({"kvpilot": batch(120.0)}),
        "avx2_int4": _doc({"kvpilot": batch(160.0)}),
        "avx2_hf_bfloat16": _doc({"hf": batch(64.0)}),
    }
    s = i14.summarize(runs, docs)
    assert s["ratios"] == {
        "single_int4_vs_llamacpp": 1.3,
        "single_speculative_vs_llamacpp": 2.0,
        "avx2_batch_vs_llamacpp": 1.6,
        "avx2_batch_vs_hf_fastest": 2.5,  # 160 / 64 (bf16 beat fp32 here)
        "native_batch_vs_llamacpp": None,  # not among --parts
        "avx512_batch_vs_llamacpp": None,
    }
    assert s["targets_met"] == {
        **dict.fromkeys(s["ratios"], True),
        "native_batch_vs_llamacpp": None,
        "avx512_batch_vs_llamacpp": None,
    }
    assert "kvpilot draft (random 2-layer)" not in s["single_stream_decode_tok_per_s"]
    table = i14.markdown(s, "test CPU")
    assert "| kvpilot int4 | 52.0 | 1.3x |" in table


def test_native_batch_part_compares_every_kvpilot_path_with_the_native_llamacpp() -> None:
    """--parts native_batch: the default path, none, auto, int8 and int4 at the native ISA (no AVX2
    caps) against the native llama-server; the goal ratio takes the best kvpilot row."""
    args = i14.parse_args(["--parts", "native_batch"])
    runs = i14.plan(args, "/bin/native", None, None)
    assert [r.key for r in runs] == [
        "native_peers",
        "native_none",
        "native_auto",
        "native_int8",
        "native_int4",
    ]
    assert all(r.part == "native_batch" and r.env == {} for r in runs)
    assert opt(runs[0].argv, "--engines") == "kvpilot,llamacpp"
    assert opt(runs[0].argv, "--llamacpp-bin") == "/bin/native"
    assert "--kvpilot-quantization" not in runs[0].argv  # the default path
    assert [opt(r.argv, "--kvpilot-quantization") for r in runs[1:]] == ["none", "auto", "int8", "int4"]
    batch = lambda v: {"batch": {"output_tok_per_s": v}}  # noqa: E731
    docs: dict[str, dict[str, Any] | None] = {
        "native_peers": _doc({"kvpilot": batch(300.0), "llamacpp": batch(100.0)}),
        "native_none": _doc({"kvpilot": batch(150.0)}),
        "native_auto": _doc({"kvpilot": batch(420.0)}),
        "native_int8": None,
        "native_int4": _doc({"kvpilot": batch(400.0)}),
    }
    s = i14.summarize(runs, docs)
    assert s["ratios"]["native_batch_vs_llamacpp"] == 4.2
    assert s["native_batch_output_tok_per_s"]["kvpilot default"]["vs_llamacpp"] == 3.0
    assert "| batch, native ISA |" in i14.markdown(s, "test CPU")


def test_llamacpp_version_matches_the_adapter() -> None:
    from peers.engine_llamacpp import DEFAULT_LLAMACPP_VERSION

    assert i14.LLAMACPP_VERSION == DEFAULT_LLAMACPP_VERSION


def test_combine_single_is_total_decode_tokens_over_total_decode_time() -> None:
    from runtime_vs_peers import combine_single

    a = {"output_tokens": 11, "decode_tok_per_s": 10.0, "steps": 11}  # 10 decode tokens in 1 s
    b = {
        "output_tokens": 31,
        "decode_tok_per_s": 30.0,
        "steps": 7,
        "proposed_tokens": 8,
        "accepted_tokens": 6,
    }
    out = combine_single([a, b])
    assert out["decode_tok_per_s"] == 20.0  # 40 tokens / 2 s, not the mean of rates either way
    assert out["per_prompt_decode_tok_per_s"] == [10.0, 30.0]
    assert out["steps"] == 18
    assert "acceptance_rate" not in out  # not every prompt reported speculation
    assert combine_single([a]) is a
    assert "error" in combine_single([a, {"error": "fewer than 2 tokens"}])


def test_build_script_refuses_an_unknown_isa() -> None:
    res = subprocess.run(
        ["bash", str(BENCH / "build_llamacpp.sh"), "--isa", "avx512vnni"], capture_output=True, text=True
    )
    assert res.returncode == 2
    assert "--isa must be native, avx2 or avx512, not 'avx512vnni'" in res.stderr


def test_build_script_refuses_a_cached_avx512_binary_with_vnni_instructions(tmp_path: Path) -> None:
    """--isa avx512 is the llama-server of a CPU without VNNI and BF16: a cached binary that uses them
    (a native build on this machine, say) is refused, one with AVX-512 F alone is taken."""
    src = tmp_path / "v.c"
    src.write_text(
        "#include <immintrin.h>\n"
        "int main(int c, char **v) { (void)v; __m512i a = _mm512_set1_epi32(c);\n"
        "#ifdef VNNI\n a = _mm512_dpbusd_epi32(a, a, a);\n#else\n a = _mm512_add_epi32(a, a);\n#endif\n"
        " return _mm512_reduce_add_epi32(a) & 1; }\n"
    )
    out = {}
    for name, flags in (("vnni", ["-mavx512f", "-mavx512vnni", "-DVNNI"]), ("skx", ["-mavx512f"])):
        build = tmp_path / name
        binary = build / "llama.cpp-0.3.36-avx512" / "bin" / "llama-server"
        binary.parent.mkdir(parents=True)
        subprocess.run(["cc", "-O2", *flags, str(src), "-o", str(binary)], check=True)
        out[name] = subprocess.run(
            ["bash", str(BENCH / "build_llamacpp.sh"), "--isa", "avx512"],
            capture_output=True,
            text=True,
            env={**os.environ, "LLAMACPP_BUILD_DIR": str(build)},
        )
    assert out["vnni"].returncode == 1
    assert "VNNI/BF16/AMX instructions; not a Skylake-class build" in out["vnni"].stderr
    assert out["skx"].returncode == 0 and out["skx"].stdout.strip().endswith("bin/llama-server")


def test_avx512_instruction_count_tells_an_avx2_build_from_an_avx512_one(tmp_path: Path) -> None:
    src = tmp_path / "v.c"
    src.write_text(
        "void add(float *a, const float *b, int n) { for (int i = 0; i < n; i++) a[i] += b[i] * 3.0f; }\n"
        "int main(void) { float a[64] = {0}, b[64] = {1}; add(a, b, 64); return (int)a[0]; }\n"
    )
    counts = {}
    for name, flags in (
        ("avx512", ["-mavx512f", "-mprefer-vector-width=512"]),
        ("avx2", ["-mavx2", "-mfma"]),
    ):
        subprocess.run(["cc", "-O3", *flags, str(src), "-o", str(tmp_path / name)], check=True)
        counts[name] = i14.avx512_instruction_count(str(tmp_path / name))
    assert counts["avx2"] == 0
    assert counts["avx512"] is not None and counts["avx512"] > 0
