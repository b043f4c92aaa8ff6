#!/usr/bin/env bash
# Issue #41's GPU benchmarks in one pass on one CUDA GPU, each section under its own time limit (a section that fails
# or runs out of time leaves the others' results): writes OUT/round.log and OUT/all.tgz (every section's folder, raw
# logs included; re-packed after each section: two files, as the benchmark machine's tool returns few).
#   bash benchmarks/gpu/round.sh OUT [BUDGET_S]          # ~9.5 minutes on an H200 (BUDGET_S, default 570)
#   HFPAR_ROUND_CPU=1 bash benchmarks/gpu/round.sh OUT   # every section's code path on CPU, tiny shapes (~6 minutes)
#   HFPAR_ROUND_SECTIONS=sft_peers bash benchmarks/gpu/round.sh OUT 380    # some sections (two calls of a lease)
# Sections: 1. SFT, Llama-3.2-3B shape, rows of 4096: hfpar eager / compiled / FP8 + compiled vs TRL's SFTTrainer
# (benchmarks/gpu/peers.py); 2. GPU busy (kernel time / step wall) of hfpar's SFT steps, prefetch on and off
# (benchmarks/gpu/profile.py); 3. DPO vs TRL's DPOTrainer on the 1024-wide model, profiled (GPU busy), and on a 3.3B
# Llama shape (benchmarks/dpo/speed.py); 4. the Qwen3-30B-A3B-shaped MoE block and 4-layer slice vs transformers'
# grouped_mm (benchmarks/moe/gpu.py); 5. hfpar_varlen (torch's FlashAttention-2 varlen kernel over one-row batches):
# its CUDA test against sdpa and one attention layer's speed (benchmarks/varlen/attention.py); 6. DPO compiled
# (--torch_compile), profiled (GPU busy); 7. DPO on the 3.3B Llama shape vs TRL; 8. torchtitan's own trainer on
# peers.py's rows (benchmarks/gpu/titan.py; its wheels travel in .devwheels/titan: `carry` it). Add
# hfpar_varlen,hfpar_varlen_compile to HFPAR_ROUND_VARIANTS for SFT.
set -uo pipefail
out=${1:?usage: round.sh OUT [BUDGET_S]}
budget=${2:-570}
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d /tmp/hfpar-round-XXXX)
cd "$(dirname "$0")/../.."
start=$SECONDS
exec > >(tee "$out/round.log") 2>&1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
cpu=${HFPAR_ROUND_CPU:-}

pack() { cp "$out/round.log" "$work/" && tar czf "$out/all.tgz.tmp" -C "$work" . && mv "$out/all.tgz.tmp" "$out/all.tgz"; }
# section NAME SECONDS CMD...: runs CMD under `timeout` (at most SECONDS, at most what is left of the budget)
section() {
    local name=$1 limit=$2
    shift 2
    if [ -n "${HFPAR_ROUND_SECTIONS:-}" ] && ! [[ ",$HFPAR_ROUND_SECTIONS," == *",${name%%_prefetch*},"* ]]; then
        return  # not asked for (HFPAR_ROUND_SECTIONS=varlen,sft_peers,sft_busy,dpo_busy,...: a subset, in this order)
    fi
    local left=$((budget - (SECONDS - start) - 15))
    [ "$limit" -gt "$left" ] && limit=$left
    if [ "$limit" -lt 30 ]; then
        echo "[round] $name: skipped, $left s of the budget left"
        return
    fi
    echo "[round] $name: start at $((SECONDS - start)) s, limit $limit s: $*"
    timeout --signal=INT --kill-after=10 "$limit" "$@"
    echo "[round] $name: exit $? at $((SECONDS - start)) s"
    pack
}

python3 - <<'PY'
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")
for m in ("transformers", "accelerate", "datasets", "trl", "liger_kernel", "torchao", "pyarrow", "peft"):
    try:
        print(m, getattr(importlib.import_module(m), "__version__", "?"))
    except Exception as e:  # noqa: BLE001
        print(m, "MISSING", type(e).__name__, str(e)[:200])
PY
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv 2>/dev/null

if [ -n "$cpu" ]; then
    peers=(--shape tiny --device cpu --seq_len 256 --steps 3 --warmup 1 --docs 40)
    prof=(--steps 4 --profile_from 2 --profile_steps 1 --seq_len 128 --batch_size 2 --hidden 128 --layers 2)
    dpo=(--device cpu --dtype float32 --steps 3 --rounds 1)
    dpo_big=(--device cpu --dtype float32 --hidden 128 --layers 2 --steps 3 --rounds 1 --no-profile)
    moe=(--device cpu --scale tiny --dtype float32 --budget_s 60)
    varlen=(--device cpu --heads 8 --kv_heads 2 --dtype float32 --row_len 1024 --repeats 3)
    titan=(--device cpu --shape tiny --seq_len 256 --steps 3 --warmup 1 --docs 40)
else
    peers=()
    prof=()
    dpo=(--device cuda --steps "${HFPAR_ROUND_DPO_STEPS:-20}")
    dpo_big=(--device cuda --hidden 3072 --layers 28 --vocab 128256 --batch 8 --steps 8 --rounds 1 --no-profile)
    moe=(--device cuda --budget_s 60)
    varlen=()
    titan=()
fi
section varlen 90 bash -c 'python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/unit/test_varlen_attention.py \
    && python3 -m benchmarks.varlen.attention --out "$0/varlen" "${@}"' "$work" "${varlen[@]}"
section sft_peers 360 python3 -m benchmarks.gpu.peers --out "$work/peers" "${peers[@]}" --variant_timeout 150 \
    --variants "${HFPAR_ROUND_VARIANTS:-hfpar,trl,hfpar_compile,trl_liger,hfpar_fp8_compile,hfpar_liger}"
for pf in 2 0; do
    section "sft_busy_prefetch$pf" 60 python3 -m benchmarks.gpu.profile --out "$work/busy" --recipe sft \
        --tag "sft_prefetch$pf" "${prof[@]}" -- --dataloader_prefetch_factor "$pf"
done
section dpo_busy 100 python3 -m benchmarks.dpo.speed --out "$work/dpo" "${dpo[@]}"
section moe 90 python3 -m benchmarks.moe.gpu --out "$work/moe" "${moe[@]}"
section dpo_busy_compile 150 python3 -m benchmarks.dpo.speed --out "$work/dpo" "${dpo[@]}" --hfpar_extra="--torch_compile"
section dpo_3b 130 python3 -m benchmarks.dpo.speed --out "$work/dpo_3b" "${dpo_big[@]}"
# torchtitan beside peers.py's rows (its wheels: .devwheels/titan, git-ignored: carry it to the machine); 0.3.0 on
# torch >= 2.13, else 0.2.2 (the newest that trains on torch 2.11, the H200 image's)
tv=$(python3 -c 'import torch; print("0.3.0" if tuple(map(int, torch.__version__.split(".")[:2])) >= (2, 13) else "0.2.2")')
section titan 330 bash -c 'work=$0 v=$1 && shift && python3 -m pip install -q --no-index --no-deps --no-compile \
    --target "$work/titan_pkgs" ".devwheels/titan/torchtitan-$v-py3-none-any.whl" \
    .devwheels/titan/{torchdata,tyro,docstring_parser,typeguard,spmd_types}-*.whl || exit 1
    peers=() && [ -f "$work/peers/peers.json" ] && peers=(--peers "$work/peers/peers.json")
    PYTHONPATH="$work/titan_pkgs:$PYTHONPATH" python3 -m benchmarks.gpu.titan --out "$work/titan" "${peers[@]}" "$@"' \
    "$work" "$tv" "${titan[@]}"
echo "[round] done at $((SECONDS - start)) s"
pack
