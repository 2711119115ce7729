"""The kernel switches (kernels/switches.py): config fields and flags, environment overrides read in
one place, and the one pure choice of attention backend (kernels/attention.choose_backend)."""

from __future__ import annotations

import argparse

import pytest
import torch

from kvpilot.kernels import isa, switches
from kvpilot.kernels.attention import Heads, Installed, choose_backend, flash_reads_in_place
from kvpilot.kernels.switches import KernelSwitches
from kvpilot.runtime.cli import add_arguments, build_config
from kvpilot.runtime.config import ConfigError, EngineConfig
from kvpilot.runtime.engine.runner import kernel_switches


def test_environment_overrides_are_parsed_and_checked() -> None:
    assert switches.from_environ({}) == {}
    assert switches.from_environ({"KVPILOT_CPU_ISA": "", "UNRELATED": "x"}) == {}  # empty: no override
    assert switches.from_environ(
        {
            "KVPILOT_CPU_ISA": "avx2",
            "KVPILOT_DISABLE_CPU_KERNEL": "1",
            "KVPILOT_QMATMUL_ACTIVATIONS": "float",
            "KVPILOT_CPU_DECODER_STACK": "0",
            "KVPILOT_KERNEL_CACHE": "/tmp/k",
            "CC": "clang",
        }
    ) == {
        "cpu_isa": "avx2",
        "cpu_kernels": False,
        "qmatmul_activations": "float",
        "cpu_decoder_stack": False,
        "kernel_cache": "/tmp/k",
        "compiler": "clang",
    }
    with pytest.raises(
        ValueError, match="KVPILOT_QMATMUL_ACTIVATIONS='fp8': expected int8 or int16 or bf16 or float"
    ):
        switches.from_environ({"KVPILOT_QMATMUL_ACTIVATIONS": "fp8"})
    with pytest.raises(ValueError, match="KVPILOT_CPU_DECODER_STACK='yes': expected 0 or 1"):
        switches.from_environ({"KVPILOT_CPU_DECODER_STACK": "yes"})
    with pytest.raises(ValueError, match="KVPILOT_CPU_ISA='sse9': expected avx512 or avx2 or generic"):
        switches.from_environ({"KVPILOT_CPU_ISA": "sse9"})


def test_flags_become_config_fields_and_the_environment_overrides_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for var in switches.ENVIRONMENT:
        monkeypatch.delenv(var, raising=False)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = ["--no-cpu-decoder-stack", "--qmatmul-activations", "float", "--kernel-cache-dir", "/tmp/kc"]
    cfg = build_config(parser.parse_args(flags))
    assert (cfg.cpu_decoder_stack, cfg.qmatmul_activations, cfg.kernel_cache_dir) == (
        False,
        "float",
        "/tmp/kc",
    )
    assert kernel_switches(cfg) == KernelSwitches(
        cpu_decoder_stack=False, qmatmul_activations="float", kernel_cache="/tmp/kc"
    )
    assert kernel_switches(EngineConfig()) == KernelSwitches()
    monkeypatch.setenv("KVPILOT_CPU_DECODER_STACK", "1")
    monkeypatch.setenv("KVPILOT_DISABLE_CPU_KERNEL", "1")
    got = kernel_switches(cfg)
    assert got.cpu_decoder_stack and not got.cpu_kernels and got.qmatmul_activations == "float"
    with pytest.raises(ValueError, match="qmatmul_activations"):
        EngineConfig.model_validate({"qmatmul_activations": "fp8"})


def test_an_override_the_environment_gets_wrong_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPILOT_QMATMUL_ACTIVATIONS", "fp8")
    with pytest.raises(ConfigError, match="KVPILOT_QMATMUL_ACTIVATIONS='fp8'"):
        kernel_switches(EngineConfig())


def test_an_isa_the_cpu_cannot_run_is_refused_naming_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(isa, "cpu_features", lambda: frozenset({"avx2", "fma", "f16c"}))  # an AVX2-only CPU
    monkeypatch.setattr(isa, "is_x86", lambda: True)
    assert kernel_switches(EngineConfig(cpu_isa="avx2")).cpu_isa == "avx2"
    with pytest.raises(ConfigError, match=r"--cpu-isa avx512: .*needs CPU features"):
        kernel_switches(EngineConfig(cpu_isa="avx512"))


def test_the_isa_switch_picks_the_level_in_force() -> None:
    assert isa.selected() == (switches.current().cpu_isa or isa.runnable()[0])
    with switches.using(cpu_isa="generic"):
        assert isa.selected() == "generic"
    assert isa.selected() == (switches.current().cpu_isa or isa.runnable()[0])


def test_using_restores_the_switches_in_force() -> None:
    before = switches.current()
    with switches.using(qmatmul_activations="float") as inside:
        assert switches.current() is inside and not inside.int8_activations
    assert switches.current() is before
    with pytest.raises(ValueError, match="cpu_isa='sse9'"):
        KernelSwitches(cpu_isa="sse9")


F16, BF16, F32, I8 = torch.float16, torch.bfloat16, torch.float32, torch.int8
EVERYTHING = Installed(flash_attn=True, triton=True, cpu_kernel=True)


@pytest.mark.parametrize(
    ("device", "kv_dtype", "block", "have", "cpu_kernels", "want"),
    [
        ("cuda", F16, 256, EVERYTHING, True, "flash-attn"),  # flash-attn pages the pool in place
        ("cuda", BF16, 16, EVERYTHING, True, "triton"),  # blocks flash-attn would have to pack
        ("cuda", I8, 256, EVERYTHING, True, "triton"),  # flash-attn reads 16-bit pools only
        ("cuda", F32, 256, EVERYTHING, True, "triton"),
        ("cuda", F16, 16, Installed(flash_attn=True), True, "flash-attn"),  # packed, without Triton
        ("cuda", I8, 16, Installed(flash_attn=True), True, "torch"),
        ("cuda", F16, 16, Installed(), True, "torch"),
        ("cpu", F32, 16, EVERYTHING, True, "cpu-paged"),
        ("cpu", BF16, 16, Installed(cpu_kernel=True), True, "cpu-paged"),
        ("cpu", F32, 16, Installed(cpu_kernel=True), False, "torch"),  # --no-cpu-kernels
        ("cpu", F32, 16, Installed(), True, "torch"),  # no C compiler
        ("mps", F16, 16, EVERYTHING, True, "torch"),
    ],
)
def test_one_backend_choice(
    device: str, kv_dtype: torch.dtype, block: int, have: Installed, cpu_kernels: bool, want: str
) -> None:
    assert choose_backend(device, kv_dtype, block, have, cpu_kernels) == want


@pytest.mark.parametrize(
    ("device", "kv_dtype", "heads", "want"),
    [
        ("cpu", F32, Heads(32, 256), "cpu-paged"),  # the C kernel's limits, both at once
        ("cpu", BF16, Heads(4, 320), "torch"),  # head_dim past 256
        ("cpu", F32, Heads(33, 64), "torch"),  # more than 32 query heads a KV head
        ("cpu", F32, None, "cpu-paged"),  # heads not known
        ("cuda", F16, Heads(4, 320), "flash-attn"),  # the CPU kernel's limits only
    ],
)
def test_heads_past_the_cpu_kernel_take_torch(
    device: str, kv_dtype: torch.dtype, heads: Heads | None, want: str
) -> None:
    block = 256 if device == "cuda" else 16
    assert choose_backend(device, kv_dtype, block, EVERYTHING, True, heads) == want


def test_the_default_block_size_follows_the_backend_choice() -> None:
    assert flash_reads_in_place("cuda", BF16, EVERYTHING)
    assert not flash_reads_in_place("cuda", I8, EVERYTHING)
    assert not flash_reads_in_place("cuda", F16, Installed(triton=True))
    assert not flash_reads_in_place("cpu", F16, EVERYTHING)


def test_select_backend_makes_the_chosen_one() -> None:
    from kvpilot.kernels.attention import installed, select_backend

    cpu = torch.device("cpu")
    want = choose_backend("cpu", F32, 16, installed("cpu"), switches.current().cpu_kernels)
    assert select_backend(cpu, block_size=16, kv_dtype=F32).name == want
    with switches.using(cpu_kernels=False):
        assert select_backend(cpu, block_size=16, kv_dtype=F32).name == "torch"
