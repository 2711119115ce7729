"""Fleet simulator sanity and determinism; `kvpilot autoscaler` CLI errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpilot.autoscaler.calibration import Calibration
from kvpilot.autoscaler.fleet_policies import KvpilotPolicy, MovingAveragePolicy, StaticPolicy
from kvpilot.autoscaler.simulator import simulate, size_static_for_slo
from kvpilot.autoscaler.spec import ScalingTargets
from kvpilot.autoscaler.trace import TraceError, TraceRequest, format_trace, parse_trace
from kvpilot.cli import main

FAST = Calibration(startup_s=30.0)


def step_trace(low: float, high: float, t_switch: float, duration: float) -> list[TraceRequest]:
    """Evenly spaced arrivals: `low` req/s, then `high` req/s from t_switch (deterministic, no RNG)."""
    out, t = [], 0.0
    while t < duration:
        out.append(TraceRequest(round(t, 3), 300 + int(t * 7) % 400, 80 + int(t * 13) % 120))
        t += 1.0 / (low if t < t_switch else high)
    return out


TRACE = step_trace(1.0, 6.0, 400.0, 900.0)


def test_one_request_ttft_is_prefill_time():
    res = simulate([TraceRequest(0.0, 1000, 10)], StaticPolicy(1), FAST, warmup_s=0)
    # 1000 prompt tokens fit in one 2048-token step: TTFT = overhead + prefill time.
    assert res.ttft_p50_s == pytest.approx(FAST.step_seconds(0, 1000))
    assert res.slo_attainment == 1.0 and res.rejected == 0


def test_deterministic():
    a = simulate(TRACE, KvpilotPolicy(ScalingTargets(min_replicas=1, max_replicas=10)), FAST).to_dict()
    b = simulate(TRACE, KvpilotPolicy(ScalingTargets(min_replicas=1, max_replicas=10)), FAST).to_dict()
    assert a == b


def test_more_replicas_never_hurt_and_cost_more():
    small = simulate(TRACE, StaticPolicy(1), FAST)
    big = simulate(TRACE, StaticPolicy(4), FAST)
    assert big.slo_attainment >= small.slo_attainment
    assert big.replica_hours > small.replica_hours
    assert big.replica_hours == pytest.approx(4 * (900 - 300) / 3600, rel=0.01)


def test_kv_pressure_preempts_instead_of_failing():
    tiny = Calibration(num_kv_blocks=64, startup_s=30.0)  # 1024 tokens of KV
    res = simulate([TraceRequest(i * 0.01, 400, 200) for i in range(8)], StaticPolicy(1), tiny, warmup_s=0)
    assert res.preemptions > 0
    assert res.rejected == 0 and res.requests == 8


def test_autoscaling_follows_load():
    policy = KvpilotPolicy(ScalingTargets(min_replicas=1, max_replicas=10))
    res = simulate(TRACE, policy, FAST)
    assert res.scale_events >= 1
    assert res.peak_replicas > 1
    ma = simulate(TRACE, MovingAveragePolicy(8, window_s=120, max_replicas=10), FAST)
    assert ma.peak_replicas > 1


def test_static_sizing_search():
    n = size_static_for_slo(TRACE, FAST, 0.99, 8)
    assert 1 <= n <= 8
    assert simulate(TRACE, StaticPolicy(n), FAST).slo_attainment >= 0.99
    if n > 1:
        assert simulate(TRACE, StaticPolicy(n - 1), FAST).slo_attainment < 0.99


def test_trace_parse_errors_name_the_line():
    with pytest.raises(TraceError, match=r"t\.csv:3: prompt_tokens 'x' is not an integer"):
        parse_trace("t_seconds,prompt_tokens,output_tokens\n0,1,1\n1,x,1\n", "t.csv")
    with pytest.raises(TraceError, match=r"t\.csv:1: expected the header"):
        parse_trace("a,b,c\n", "t.csv")
    with pytest.raises(TraceError, match=r"t\.csv:3: t_seconds 0.5 goes back in time"):
        parse_trace("t_seconds,prompt_tokens,output_tokens\n1,1,1\n0.5,1,1\n", "t.csv")
    with pytest.raises(TraceError, match=r"t\.csv:2: expected 3 columns"):
        parse_trace("t_seconds,prompt_tokens,output_tokens\n1,1\n", "t.csv")
    assert parse_trace(format_trace(TRACE[:5])) == TRACE[:5]


def test_calibration_file(tmp_path: Path):
    p = tmp_path / "cal.json"
    p.write_text(json.dumps({"startup_s": 5, "num_kv_blocks": 100}))
    cal = Calibration.from_file(p)
    assert (cal.startup_s, cal.num_kv_blocks, cal.block_size) == (5, 100, 16)
    p.write_text(json.dumps({"startup": 5}))
    with pytest.raises(ValueError, match="unknown calibration field"):
        Calibration.from_file(p)


def test_cli_simulate_prints_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    trace = tmp_path / "t.csv"
    trace.write_text(format_trace(TRACE))
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"startup_s": 30}))
    for policy in ("kvpilot", "moving-average"):
        rc = main(
            [
                "autoscaler",
                "simulate",
                "--trace",
                str(trace),
                "--policy",
                policy,
                "--calibration",
                str(cal),
                "--max-replicas",
                "8",
                "--slo-ttft",
                "2.5",
            ]
        )
        assert rc == 0
        out = json.loads(capsys.readouterr().out)
        assert out["policy"] == policy
        assert {"slo_attainment", "replica_hours", "scale_events", "settings"} <= set(out)
        assert out["slo_ttft_s"] == 2.5
        assert out["settings"]["calibration"]["startup_s"] == 30
    rc = main(["autoscaler", "simulate", "--trace", str(trace), "--policy", "static", "--replicas", "2"])
    assert rc == 0
    assert json.loads(capsys.readouterr().out)["settings"]["policy"]["replicas"] == 2


def test_cli_bad_csv_names_the_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    trace = tmp_path / "bad.csv"
    trace.write_text("t_seconds,prompt_tokens,output_tokens\n0.0,10,10\n1.0,ten,10\n")
    assert main(["autoscaler", "simulate", "--trace", str(trace)]) == 2
    err = capsys.readouterr().err
    assert "--trace" in err and "bad.csv:3" in err and "prompt_tokens 'ten'" in err


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["simulate", "--trace", "x.csv", "--policy", "hpa"], "--policy"),
        (["simulate", "--trace", "x.csv", "--slo-ttft", "-1"], "--slo-ttft"),
        (["simulate", "--trace", "x.csv", "--slo-ttft", "fast"], "--slo-ttft"),
        (["simulate", "--trace", "x.csv", "--target-kv", "1.5"], "--target-kv"),
        (["run", "--interval", "0"], "--interval"),
        (["run", "--metrics-source", "statsd"], "--metrics-source"),
        (["run", "--namespace", "a", "--all-namespaces"], "--all-namespaces"),
        (["simulate"], "--trace"),
    ],
)
def test_cli_bad_flags_name_the_flag(argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exc:
        main(["autoscaler", *argv])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def test_cli_missing_trace_file(capsys: pytest.CaptureFixture[str]):
    assert main(["autoscaler", "simulate", "--trace", "/nonexistent/t.csv"]) == 2
    assert "--trace" in capsys.readouterr().err


def test_cli_bad_kubeconfig(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    assert main(["autoscaler", "run", "--kubeconfig", str(tmp_path / "missing")]) == 2
    assert "--kubeconfig" in capsys.readouterr().err


def test_cli_behavior_flags_reach_the_policy():
    from argparse import ArgumentParser

    from kvpilot.autoscaler.cli import add_arguments, behavior_from_args

    parser = ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "simulate", "--trace", "t.csv",
            "--scale-down-rule", "2,25,30", "--scale-up-rule", "4,100,60",
            "--scale-down-exponent", "1", "--queue-recommendation", "least-loaded", "--tolerance", "0.05",
        ]
    )  # fmt: skip
    b = behavior_from_args(args)
    assert (b.scale_down.pods, b.scale_down.percent, b.scale_down.period_s) == (2, 25.0, 30.0)
    assert b.scale_up.period_s == 60.0
    assert b.scale_down_exponent == 1.0 and b.queue_recommendation == "least-loaded"
    assert b.tolerance == 0.05
    assert b.arrival_rate  # on by default
    args = parser.parse_args(
        [
            "simulate", "--trace", "t.csv", "--no-arrival-rate", "--arrival-lead", "0",
            "--arrival-trend-window", "90", "--arrival-headroom", "1.2",
        ]
    )  # fmt: skip
    b = behavior_from_args(args)
    assert not b.arrival_rate and b.arrival_lead_s == 0.0
    assert b.arrival_trend_window_s == 90.0 and b.arrival_headroom == 1.2
    assert (b.redundancy_replicas, b.redundancy_load) == (2, 0.5)  # the defaults
    args = parser.parse_args(
        ["simulate", "--trace", "t.csv", "--redundancy-replicas", "1", "--redundancy-load", "0.8"]
    )
    b = behavior_from_args(args)
    assert (b.redundancy_replicas, b.redundancy_load) == (1, 0.8)
    assert b.scale_down_surplus_share == 0.5  # the default
    args = parser.parse_args(["simulate", "--trace", "t.csv", "--scale-down-surplus-share", "0"])
    assert behavior_from_args(args).scale_down_surplus_share == 0.0
    for bad in (
        ["--redundancy-replicas", "0"],
        ["--redundancy-load", "-1"],
        ["--scale-down-surplus-share", "1.5"],
        ["--scale-down-surplus-share", "-0.1"],
    ):
        with pytest.raises(SystemExit):
            parser.parse_args(["simulate", "--trace", "t.csv", *bad])
    with pytest.raises(SystemExit):
        parser.parse_args(["simulate", "--trace", "t.csv", "--arrival-lead", "-1"])
    with pytest.raises(SystemExit):
        parser.parse_args(["simulate", "--trace", "t.csv", "--scale-down-rule", "1,2"])


def _mooncake_lines(n: int) -> str:
    return "".join(
        json.dumps(
            {
                "timestamp": i * 200,
                "input_length": 1024 + 512 * (i % 3),
                "output_length": 20,
                "hash_ids": list(range(2 + i % 3)),
            }
        )
        + "\n"
        for i in range(n)
    )


def test_cli_contract_on_a_jsonl_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    trace = tmp_path / "m.jsonl"
    trace.write_text(_mooncake_lines(300))
    keys = {
        "slo_attainment", "replica_hours", "scale_events", "peak_replicas", "ttft_p50_s", "ttft_p99_s",
        "tpot_p50_s", "prefix_hit_rate", "settings",
    }  # fmt: skip
    base = ["autoscaler", "simulate", "--trace", str(trace), "--calibration", "l4/smollm2-135m"]
    base += ["--startup-s", "12", "--slo-ttft", "1.5", "--slo-tpot", "0.04", "--min-replicas", "1"]
    base += ["--max-replicas", "4", "--warmup", "0"]
    for extra in (
        ["--policy", "kvpilot", "--router", "least-loaded"],
        ["--policy", "static"],
        ["--policy", "moving-average", "--rate-scale", "2"],
    ):
        assert main([*base, *extra]) == 0
        out = json.loads(capsys.readouterr().out)
        assert keys <= set(out)
        assert out["slo_tpot_s"] == 0.04 and out["slo_ttft_s"] == 1.5
        assert out["settings"]["calibration"]["startup_s"] == 12
        assert out["settings"]["calibration_name"] == "l4/smollm2-135m"
        assert out["prefix_hit_rate"] > 0.0  # repeated hash_ids hit the cache
        assert out["load_per_minute"][0]["requests_per_s"] == pytest.approx(
            5.0 * out["settings"]["rate_scale"], rel=0.01
        )
    # --policy static without --replicas: the smallest fleet meeting the target.
    assert main([*base, "--policy", "static"]) == 0
    static = json.loads(capsys.readouterr().out)
    n = static["settings"]["policy"]["replicas"]
    assert static["slo_attainment"] >= 0.99 or n == 4
    if n > 1:
        assert main([*base, "--policy", "static", "--replicas", str(n - 1)]) == 0
        assert json.loads(capsys.readouterr().out)["slo_attainment"] < 0.99


def test_cli_startup_sweep(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    trace = tmp_path / "m.jsonl"
    trace.write_text(_mooncake_lines(200))
    argv = [
        "autoscaler",
        "simulate",
        "--trace",
        str(trace),
        "--calibration",
        "l4/smollm2-135m",
        "--warmup",
        "0",
    ]
    assert main([*argv, "--startup-sweep"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["startup_s"] for r in out["startup_sweep"]] == [0.0, 10.0, 30.0, 60.0, 120.0]
    assert main([*argv, "--startup-sweep", "--startup-s", "5"]) == 2
    assert "--startup-sweep" in capsys.readouterr().err


def test_cli_calibration_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exc:
        main(["autoscaler", "simulate", "--list-calibrations"])
    assert exc.value.code == 0
    names = [c["name"] for c in json.loads(capsys.readouterr().out)]
    assert "h100/llama-3.1-8b" in names and "h200/mixtral-8x7b" in names
    trace = tmp_path / "m.jsonl"
    trace.write_text(_mooncake_lines(5))
    assert main(["autoscaler", "simulate", "--trace", str(trace), "--calibration", "tpu/llama-3.1-8b"]) == 2
    err = capsys.readouterr().err
    assert "--calibration: unknown GPU 'tpu'" in err and "h100, h200, a100, l40s, l4" in err


def test_cli_bad_jsonl_names_file_and_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    trace = tmp_path / "bad.jsonl"
    trace.write_text(
        '{"timestamp": 5, "input_length": 10, "output_length": 2}\n{"timestamp": 1, "input_length": 10, "output_length": 2}\n'
    )
    assert main(["autoscaler", "simulate", "--trace", str(trace)]) == 2
    assert f"--trace: {trace}:2: timestamp 1 goes back in time" in capsys.readouterr().err
