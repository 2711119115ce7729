"""ISA level selection (kernels/isa.py): from the CPU's features, overridable, refused when impossible."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvpilot.kernels import cpu_attention, cpu_ops, isa, switches
from tests.needs import missing

AVX512_CPU = {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd", "avx2", "fma", "f16c", "avx512_bf16"}
EPYC_AVX2 = {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"}


def test_levels_follow_the_features() -> None:
    assert isa.supported(AVX512_CPU) == ["avx512", "avx2", "generic"]
    assert isa.supported(EPYC_AVX2) == ["avx2", "generic"]
    assert isa.supported({"avx2", "fma"}) == ["generic"]  # no F16C: the avx2 build would not run
    assert isa.supported(AVX512_CPU, x86=False) == ["generic"]
    assert isa.choose(AVX512_CPU, None) == "avx512"
    assert isa.choose(EPYC_AVX2, None) == "avx2"


def test_override_is_validated_and_names_the_variable() -> None:
    assert isa.choose(AVX512_CPU, "avx2") == "avx2"
    assert isa.choose(EPYC_AVX2, "generic") == "generic"
    with pytest.raises(ValueError, match="KVPILOT_CPU_ISA=avx512 needs CPU features"):
        isa.choose(EPYC_AVX2, "avx512")
    with pytest.raises(ValueError, match="KVPILOT_CPU_ISA='sse9' is not one of"):
        isa.choose(AVX512_CPU, "sse9")


def test_flags_are_explicit_per_level() -> None:
    assert isa.compile_flags("avx512", AVX512_CPU)[:1] == ["-march=x86-64-v4"]
    assert "-mavx512bf16" in isa.compile_flags("avx512", AVX512_CPU)
    assert "-mavx512bf16" not in isa.compile_flags("avx512", AVX512_CPU - {"avx512_bf16"})
    assert isa.compile_flags("avx2", AVX512_CPU)[:1] == ["-march=x86-64-v3"]
    assert isa.compile_flags("generic", AVX512_CPU)[:1] == ["-march=x86-64"]
    for level in isa.LEVELS:
        assert not any("native" in f for f in isa.compile_flags(level, AVX512_CPU))


def test_every_runnable_level_builds_what_it_names() -> None:
    """Each extension's build for each level this CPU runs reports that level from its own macros."""
    if not cpu_attention.available() or not cpu_ops.available():
        missing("a C compiler for the CPU kernels", "install gcc or clang")
    assert isa.selected() in isa.runnable()
    for level in isa.runnable():
        assert cpu_attention.built_isa(level) == level
        assert cpu_ops.built_isa(level) == level


def test_hidden_features_are_parsed_and_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    assert switches.hidden_features(" avx512_bf16, avx512_vnni ,") == {"avx512_bf16", "avx512_vnni"}
    assert switches.hidden_features("") == frozenset()
    with pytest.raises(ValueError, match="KVPILOT_CPU_HIDE_FEATURES='avx2,AVX512': AVX512 is not a CPU"):
        switches.hidden_features("avx2,AVX512")
    monkeypatch.setenv(
        switches.HIDE_FEATURES_ENV, "avx512-bf16"
    )  # refused where the engine resolves its switches
    with pytest.raises(ValueError, match="KVPILOT_CPU_HIDE_FEATURES='avx512-bf16'"):
        switches.resolve()


def test_hidden_features_make_the_kernels_those_of_a_cpu_without_them() -> None:
    """KVPILOT_CPU_HIDE_FEATURES (scripts/test.sh's AVX-512-without-BF16 run) reaches every decision:
    the features, the build flags, the routing, and the built library's own macros."""
    if not cpu_attention.available():
        missing("a C compiler for the CPU kernels", "install gcc or clang")
    code = (
        "from kvpilot.kernels import cpu_moe, isa\n"
        "f = isa.cpu_features()\n"
        "assert not {'avx512_bf16', 'avx512_vnni'} & f, f\n"
        "assert not {'-mavx512bf16', '-mavx512vnni'} & set(isa.flags_for('avx512'))\n"
        "assert not isa.bf16_dot('avx512') and not isa.native_bf16('avx512')\n"
        "if 'avx512' in isa.runnable():\n"
        "    assert not cpu_moe.bf16_dot('avx512')  # the build's own __AVX512BF16__\n"
        "print('ok', sorted(isa.runnable()))\n"
    )
    env = {**os.environ, switches.HIDE_FEATURES_ENV: "avx512_bf16,avx512_vnni"}
    env.pop("KVPILOT_CPU_ISA", None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("ok")
    if {"avx512_bf16"} <= isa.cpu_features() and not os.environ.get(switches.HIDE_FEATURES_ENV):
        assert isa.bf16_dot("avx512")  # unhidden, this CPU's build has it: the test above could fail
