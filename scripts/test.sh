#!/usr/bin/env bash
# The full test run: lint, types, fast CPU tests, then e2e against a real local control plane.
# Called by `./dev test` and by .ci/run. Set KVPILOT_SKIP_E2E=1 to run only the fast part.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== ruff"
ruff check .
ruff format --check .

echo "== mypy"
bash scripts/mypy.sh

# vLLM's CPU build for the tests of spec.engine: vllm (vLLM's own parser reads the operator's config
# file; e2e/test_vllm_engine_e2e.py serves a vLLM pod). Installed under CI (a cached venv of 6.4 GB:
# 3 to 8 minutes the first time on a 2-core machine, nothing after), where a missing one fails those
# tests; a local run skips them and says how to install it (KVPILOT_VLLM=1 installs it here too).
ci="$(echo "${CI:-}" | tr '[:upper:]' '[:lower:]')"
if [[ "$ci" =~ ^(1|true|yes|on)$ ]] || [ "${KVPILOT_VLLM:-0}" = "1" ]; then
  echo "== vLLM CPU build (scripts/vllm_cpu.sh)"
  bash scripts/vllm_cpu.sh
fi

echo "== unit tests (CPU)"
python -m pytest tests -q -p no:cacheprovider

# On an AVX-512 machine the run above uses the AVX-512 kernels (with BF16 and VNNI where it has them);
# the users' other CPUs take other code paths in our C kernels (kernels/isa.py) and in torch. Run the
# kernel-sensitive tests again as each such CPU this machine can stand in for (tests/kernels already
# covers each of our levels side by side).
kernel_tests=(
  tests/kernels/test_isa.py tests/kernels/test_cpu_ops.py
  "tests/runtime/test_model_parity.py::test_varlen_batch_matches_separate_runs"
  "tests/runtime/test_model_parity.py::test_chunked_prefill_with_mixed_decode"
  tests/runtime/test_long_prefill.py
  "tests/runtime/test_cpu_stack.py::test_stack_gives_the_python_layers_hidden_states"
  "tests/runtime/test_loader.py::test_resolve_dtype"
  "tests/runtime/test_quantization.py::test_int8_and_int4_models_stay_close_to_the_16_bit_one"
  "tests/runtime/test_moe_quant.py::test_fused_experts_is_the_per_expert_loop_in_one_call"
  "tests/runtime/test_moe.py::test_cpu_layer_takes_the_fused_call_up_to_the_crossover"
  "tests/runtime/test_moe.py::test_prefill_and_decode_logits_match_transformers"
  "tests/runtime/test_moe.py::test_bfloat16_prefill_takes_the_fused_call_and_tracks_transformers"
  "tests/runtime/test_engine.py::test_quantized_cache_under_preemption_stays_greedy"
)
# AVX2-only CPUs (AMD EPYC before Zen 4, laptops): our kernels forced to avx2, torch's ATen, oneDNN and
# MKL capped at AVX2.
if grep -qw avx512f /proc/cpuinfo 2>/dev/null && grep -qw avx2 /proc/cpuinfo; then
  echo "== kernel-sensitive tests as an AVX2-only CPU (KVPILOT_CPU_ISA=avx2)"
  KVPILOT_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 python -m pytest -q -p no:cacheprovider \
    "${kernel_tests[@]}"
fi
# AVX-512 CPUs without BF16 and VNNI (Skylake-X class Xeons; Cascade and Ice Lake lack BF16): the avx512
# kernels built without them and every routing decision made as on such a CPU
# (KVPILOT_CPU_HIDE_FEATURES, kernels/isa.py), oneDNN capped at AVX512_CORE; with the default path's
# quality test and the quantized matmul's, whose paths differ most there.
if grep -qw avx512f /proc/cpuinfo 2>/dev/null && grep -qwE "avx512_bf16|avx512_vnni|amx_bf16" /proc/cpuinfo; then
  echo "== kernel-sensitive tests as an AVX-512 CPU without BF16 and VNNI (KVPILOT_CPU_HIDE_FEATURES)"
  KVPILOT_CPU_HIDE_FEATURES=avx512_bf16,avx512_vnni,amx_bf16,amx_int8,amx_tile,avx_vnni ONEDNN_MAX_CPU_ISA=AVX512_CORE \
    python -m pytest -q -p no:cacheprovider "${kernel_tests[@]}" tests/kernels/test_qlinear.py \
    "tests/runtime/test_default_quality.py::test_default_dtype_tracks_float32_at_least_as_well_as_transformers_bf16[avx512]" \
    "tests/runtime/test_default_quality.py::test_the_default_path_on_a_q4_k_m_style_file_tracks_its_float32_model"
fi

if [ "${KVPILOT_SKIP_E2E:-0}" != "1" ] && [ -d e2e ] && ls e2e/test_*.py >/dev/null 2>&1; then
  echo "== e2e (local Kubernetes control plane)"
  python -m pytest e2e -q -p no:cacheprovider
fi
