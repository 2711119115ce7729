"""benchmarks/load_tools_bench.py without the tools or a server: its flags (checked, naming the flag),
what it asks inference-perf and guidellm, and the figures it reads from their reports (trimmed real
reports in data/load_tools/: inference-perf 0.7.0's stage report of a constant 1 req/s run and
guidellm 0.8.1's JSON report of a constant 1 req/s run, both against kvpilot serve)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import load_tools_bench as bench  # noqa: E402
from load_tools import reports  # noqa: E402

DATA = Path(__file__).parent / "data" / "load_tools"
EXE = sys.executable  # an executable standing in for each tool: parsing only checks that it runs


def parse(*argv: str) -> object:
    return bench.parse_args(["--inference-perf", EXE, "--guidellm", EXE, *argv])


def error_of(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        bench.parse_args(list(argv))
    assert e.value.code == 2
    return capsys.readouterr().err


def test_defaults_run_every_target_and_both_tools() -> None:
    args = parse("--targets", "kvpilot,router")
    assert args.targets == ["kvpilot", "router"]  # type: ignore[attr-defined]
    assert args.tools == ["inference-perf", "guidellm"]  # type: ignore[attr-defined]
    assert args.loads == ["constant", "poisson"]  # type: ignore[attr-defined]
    assert args.guidellm_profiles == ["constant"]  # type: ignore[attr-defined]
    assert args.workload == reports.Workload()  # type: ignore[attr-defined]
    assert args.pod_capacity == 64  # type: ignore[attr-defined]  # kvpilot serve's --max-num-seqs
    assert bench.parse_args(
        ["--targets", "vllm", "--vllm", EXE, "--vllm-model", "m", "--inference-perf", EXE, "--guidellm", EXE]
    ).targets == ["vllm"]


def test_workload_flags_reach_the_workload() -> None:
    args = parse(
        "--targets", "kvpilot", "--rate", "2.5", "--duration", "9", "--groups", "3", "--output-len", "5"
    )
    w = args.workload  # type: ignore[attr-defined]
    assert (w.rate, w.duration, w.groups, w.output_len) == (2.5, 9, 3, 5)


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--targets", "kvpilot,sglang"], "--targets"),
        (["--tools", "locust"], "--tools"),
        (["--loads", "burst"], "--loads"),
        (["--guidellm-profiles", "sweep"], "--guidellm-profiles"),
        (["--targets", "vllm"], "--vllm"),
        (["--targets", "kvpilot", "--vllm-arg=--max-num-seqs=4"], "--vllm-arg"),
        (["--targets", "kvpilot", "--pods", "0"], "--pods"),
        (["--targets", "router", "--pod-capacity", "0"], "--pod-capacity"),
        (["--targets", "kvpilot", "--rate", "0"], "--rate"),
        (["--targets", "kvpilot", "--question-len", "0"], "--question-len"),
    ],
)
def test_bad_flags_fail_naming_the_flag(
    capsys: pytest.CaptureFixture[str], argv: list[str], names: str
) -> None:
    err = error_of(capsys, "--inference-perf", EXE, "--guidellm", EXE, *argv)
    assert names in err


def test_a_tool_that_is_not_there_fails_naming_its_flag(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    missing = tmp_path / "inference-perf"
    err = error_of(
        capsys, "--targets", "kvpilot", "--tools", "inference-perf", "--inference-perf", str(missing)
    )
    assert f"--inference-perf {missing}" in err and "scripts/load_tools.sh" in err


def test_the_tools_run_offline_from_one_process() -> None:
    env = bench.tool_env()
    assert env["HF_HUB_OFFLINE"] == env["HF_DATASETS_OFFLINE"] == "1"
    assert env["GUIDELLM__MAX_WORKER_PROCESSES"] == "1"
    assert "PYTHONPATH" not in env


def test_inference_perf_config_is_the_shared_prefix_workload(tmp_path: Path) -> None:
    w = reports.Workload(rate=2, duration=15, groups=3, prompts_per_group=5, system_prompt_len=100)
    cfg = reports.inference_perf_config(
        w, "poisson", "http://127.0.0.1:9", "m", tmp_path / "tok", tmp_path / "out"
    )
    assert cfg["load"]["type"] == "poisson"
    assert cfg["load"]["stages"] == [{"rate": 2, "duration": 15}]
    assert cfg["load"]["num_workers"] == 1
    sp = cfg["data"]["shared_prefix"]
    assert cfg["data"]["type"] == "shared_prefix"
    assert (sp["num_groups"], sp["num_prompts_per_group"], sp["system_prompt_len"]) == (3, 5, 100)
    assert (sp["question_len"], sp["output_len"]) == (w.question_len, w.output_len)
    assert cfg["server"] == {
        "type": "vllm",
        "model_name": "m",
        "base_url": "http://127.0.0.1:9",
        "ignore_eos": True,
    }
    assert cfg["api"] == {"type": "completion", "streaming": True}
    assert cfg["report"]["request_lifecycle"]["use_server_output_tokens"] is True
    assert cfg["tokenizer"]["pretrained_model_name_or_path"] == str(tmp_path / "tok")
    assert cfg["storage"]["local_storage"]["path"] == str(tmp_path / "out")
    with pytest.raises(ValueError, match="burst"):
        reports.inference_perf_config(w, "burst", "u", "m", tmp_path, tmp_path)


def test_guidellm_argv_asks_the_same_shape_of_data(tmp_path: Path) -> None:
    w = reports.Workload(
        rate=0.5, duration=20, groups=4, system_prompt_len=256, question_len=64, output_len=32
    )
    argv = reports.guidellm_argv(
        "gl", w, "constant", "http://h:1", "m", tmp_path / "tok", tmp_path / "r.json"
    )
    opts = dict(zip(argv[2::2], argv[3::2], strict=False))
    assert argv[:2] == ["gl", "run"]
    assert opts["--profile"] == "kind=constant,rate=0.5"
    assert opts["--constraint"] == "kind=max_duration,seconds=20"
    assert "target=http://h:1,model=m,request_format=/v1/completions" in opts["--backend"]
    assert json.loads(opts["--data"]) == {
        "kind": "synthetic_text",
        "prompt_tokens": 64,
        "output_tokens": 32,
        "prefix_buckets": [{"prefix_tokens": 256, "prefix_count": 4}],
    }
    assert opts["--output"] == f"kind=json,path={tmp_path / 'r.json'}"
    # the loader generates the run's 10 requests and a few more, not its default 4096 beside the server
    assert opts["--data-loader"] == "kind=pytorch,prefetch_factor=18"
    with pytest.raises(ValueError, match="sweep"):
        reports.guidellm_argv("gl", w, "sweep", "u", "m", tmp_path, tmp_path)


def test_inference_perf_figures_from_its_stage_report(tmp_path: Path) -> None:
    stage = json.loads((DATA / "inference_perf_stage_0.json").read_text())
    (tmp_path / "stage_0_lifecycle_metrics.json").write_text(json.dumps(stage))
    f = reports.read_inference_perf(tmp_path)
    lat = stage["successes"]["latency"]
    assert f["requests"] == stage["successes"]["count"] == 10
    assert f["failures"] == 0
    assert f["requests_per_s"] == round(stage["successes"]["throughput"]["requests_per_sec"], 3)
    assert f["ttft_ms"]["mean"] == round(lat["time_to_first_token"]["mean"] * 1000, 2)
    assert f["ttft_ms"]["p90"] == round(lat["time_to_first_token"]["p90"] * 1000, 2)
    assert f["itl_ms"]["median"] == round(lat["inter_token_latency"]["median"] * 1000, 2)
    assert f["request_latency_s"]["p99"] == round(lat["request_latency"]["p99"], 2)
    assert f["prompt_tokens_mean"] == 320.0  # 256 shared + 64 question tokens, as asked
    (tmp_path / "stage_1_lifecycle_metrics.json").write_text("{}")
    with pytest.raises(RuntimeError, match="expected one stage report"):
        reports.read_inference_perf(tmp_path)


def test_guidellm_figures_from_its_report() -> None:
    report = json.loads((DATA / "guidellm_constant.json").read_text())
    f = reports.guidellm_figures(report)
    m = report["benchmarks"][0]["metrics"]
    assert (f["strategy"], f["rate"]) == ("constant", 1.0)
    assert (f["requests"], f["incomplete"], f["errored"]) == (18, 3, 0)
    # the throughput table's figures: means over all requests
    assert f["requests_per_s"] == round(m["requests_per_second"]["total"]["mean"], 3)
    assert f["output_tokens_per_s"] == round(m["output_tokens_per_second"]["total"]["mean"], 1)
    # the latency table's figures: completed requests
    ttft = m["time_to_first_token_ms"]["successful"]
    assert f["ttft_ms"] == {
        "mean": round(ttft["mean"], 2),
        "median": round(ttft["median"], 2),
        "p95": round(ttft["percentiles"]["p95"], 2),
        "p99": round(ttft["percentiles"]["p99"], 2),
    }
    assert f["targeted_before_start"] == 0


def test_guidellm_requests_scheduled_before_the_start_are_counted() -> None:
    report = json.loads((DATA / "guidellm_constant.json").read_text())
    first = report["benchmarks"][0]["requests"]["successful"][0]["info"]
    first["timings"]["targeted_start"] = 0.4  # an arrival anchored at the epoch: sent at once
    f = reports.guidellm_figures(report)
    assert f["targeted_before_start"] == 1
    (_, _, rows) = reports.side_by_side({"kvpilot": {"guidellm/poisson": f}})[0]
    assert rows[0][1] == "poisson (1 sent at once)"


def test_side_by_side_one_table_per_tool_a_row_per_target_and_load(tmp_path: Path) -> None:
    stage = json.loads((DATA / "inference_perf_stage_0.json").read_text())
    ip = reports.inference_perf_figures(stage)
    gl = reports.guidellm_figures(json.loads((DATA / "guidellm_constant.json").read_text()))
    results = {
        "kvpilot": {"inference-perf/constant": ip, "inference-perf/poisson": ip, "guidellm/constant": gl},
        "vllm": {"inference-perf/constant": {"error": "CalledProcessError: exit 1"}, "guidellm/constant": gl},
    }
    tables = reports.side_by_side(results)
    assert [t[0] for t in tables] == ["inference-perf", "guidellm"]
    _, headers, rows = tables[0]
    assert "TTFT p90" in headers and len({len(r) for r in rows} | {len(headers)}) == 1
    assert [(r[0], r[1]) for r in rows] == [
        ("kvpilot", "constant"),
        ("kvpilot", "poisson"),
        ("vllm", "constant"),
    ]
    assert rows[0][headers.index("TTFT mean")] == f"{ip['ttft_ms']['mean']:g}"
    assert rows[2][2] == "error: CalledProcessError: exit 1"
    _, gl_headers, gl_rows = tables[1]
    assert "ITL p95" in gl_headers and [r[0] for r in gl_rows] == ["kvpilot", "vllm"]
    assert gl_rows[0][2] == "18 (+3 unfinished)"  # completed, and those the duration cut off
