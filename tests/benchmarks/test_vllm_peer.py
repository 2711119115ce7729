"""runtime_vs_peers.py's vllm engine without starting vLLM: how `vllm serve` is started
(benchmarks/peers/vllm_cpu.py: argv, environment, OpenMP binding, the install lookup through
scripts/vllm_cpu.sh --check), the flags the comparison gives it (peers/engine_vllm.py) and the
summary's kvpilot-vs-vLLM ratio."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

from peers import vllm_cpu  # noqa: E402


def test_serve_argv_serves_the_directory_on_localhost_with_the_extra_flags_last() -> None:
    argv = vllm_cpu.serve_argv("/v/bin/vllm", "/m", "smol", 8123, ["--dtype", "bfloat16"])
    assert argv[:3] == ["/v/bin/vllm", "serve", "/m"]
    assert argv[argv.index("--served-model-name") + 1] == "smol"
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--port") + 1] == "8123"
    assert argv[-2:] == ["--dtype", "bfloat16"]


def test_omp_bind_takes_the_first_allowed_cpus() -> None:
    assert vllm_cpu.omp_bind({3, 1, 2, 7}, 2) == "1,2"
    assert vllm_cpu.omp_bind([0, 1], 2) == "0,1"
    with pytest.raises(ValueError, match="3 vLLM threads on 2 allowed CPUs"):
        vllm_cpu.omp_bind([0, 1], 3)
    with pytest.raises(ValueError):
        vllm_cpu.omp_bind([0, 1], 0)


def test_serve_env_drops_this_checkout_and_preloads_the_venvs_intel_openmp(tmp_path: Path) -> None:
    exe = tmp_path / "venv" / "bin" / "vllm"
    exe.parent.mkdir(parents=True)
    base = {"PYTHONPATH": "/repo", "HOME": "/root"}
    env = vllm_cpu.serve_env(base, exe, "0,1")
    assert "PYTHONPATH" not in env and env["HOME"] == "/root"
    assert env["VLLM_NO_USAGE_STATS"] == "1" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"
    assert "LD_PRELOAD" not in env  # no libiomp5.so in this venv
    iomp = tmp_path / "venv" / "lib" / "libiomp5.so"
    iomp.parent.mkdir()
    iomp.write_bytes(b"")
    env = vllm_cpu.serve_env(base, exe)
    assert env["LD_PRELOAD"] == str(iomp)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env  # vLLM's `auto`
    assert vllm_cpu.serve_env({**base, "LD_PRELOAD": "/x.so"}, exe)["LD_PRELOAD"] == "/x.so"


def test_a_missing_install_names_the_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPILOT_VLLM_HOME", str(tmp_path))  # nothing installed there
    with pytest.raises(FileNotFoundError) as e:
        vllm_cpu.installed(BENCH.parent)
    assert "bash scripts/vllm_cpu.sh" in str(e.value) and str(tmp_path) in str(e.value)


def test_parse_check_reads_the_scripts_lines() -> None:
    out = "venv=/a/venv\nmodel=/a/models/m=x\nnoise\n"
    assert vllm_cpu.parse_check(out) == {"venv": "/a/venv", "model": "/a/models/m=x"}


def opt(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_vllm_flags_size_the_kv_pool_like_kvpilots_and_put_extra_flags_last() -> None:
    from peers.engine_vllm import vllm_flags
    from runtime_vs_peers import parse_args

    flags = vllm_flags(parse_args(["--kvpilot-kv-gib", "1.5"]))
    assert opt(flags, "--kv-cache-memory-bytes") == str(3 << 29)
    assert opt(flags, "--dtype") == "bfloat16"
    assert (opt(flags, "--max-num-seqs"), opt(flags, "--max-num-batched-tokens")) == ("128", "2048")
    flags = vllm_flags(
        parse_args(["--vllm-kv-gib", "0.5", "--vllm-max-num-seqs", "32", "--vllm-extra=--enforce-eager"])
    )
    assert opt(flags, "--kv-cache-memory-bytes") == str(1 << 29)
    assert opt(flags, "--max-num-seqs") == "32"
    assert flags[-1] == "--enforce-eager"


def test_an_explicit_binary_that_is_not_there_fails_naming_the_flag(tmp_path: Path) -> None:
    from peers.engine_vllm import vllm_engine
    from runtime_vs_peers import parse_args

    args = parse_args(["--vllm-bin", str(tmp_path / "vllm"), "--vllm-model", str(tmp_path)])
    with pytest.raises(FileNotFoundError, match="--vllm-bin"):
        vllm_engine(args, [1, 2, 3])


def test_summary_compares_kvpilot_with_vllm_offline_and_over_http() -> None:
    from runtime_vs_peers import ALL_ENGINES, summarize

    assert "vllm" in ALL_ENGINES
    s = summarize(
        {
            "kvpilot": {"batch": {"output_tok_per_s": 300.0}},
            "kvpilot_serve": {"batch": {"output_tok_per_s": 150.0}},
            "vllm": {"batch": {"output_tok_per_s": 200.0}, "single_stream": {"decode_tok_per_s": 40.0}},
        }
    )
    assert s["batch_output_tok_per_s"]["vllm_server_http"] == 200.0
    assert s["kvpilot_vs_vllm_throughput"] == 1.5
    assert s["kvpilot_serve_vs_vllm_throughput"] == 0.75
    assert s["targets_met"]["kvpilot_vs_vllm_throughput"] is True
    assert s["single_stream_decode_tok_per_s"]["vllm_server_http"] == 40.0
    assert s["kvpilot_vs_llamacpp_throughput"] is None  # no llama.cpp figure: no ratio
