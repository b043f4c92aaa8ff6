#!/usr/bin/env bash
# How busy the GPU is in hfpar's SFT and DPO steps (kernel time / step wall, benchmarks/gpu/profile.py), with the
# next batches loaded in a background thread (--dataloader_prefetch_factor 2, the default) or in the step (0), eager
# and with regional compilation (--torch_compile). One GPU, bf16, the 0.9B Llama of benchmarks/gpu/sft.py.
#   bash benchmarks/gpu/busy.sh benchmarks/results/gpu/busy      (about 6 minutes on an H100 / H200)
set -euo pipefail
out=${1:-benchmarks/results/gpu/busy}
for recipe in sft dpo; do
  for pf in 0 2; do
    python -m benchmarks.gpu.profile --out "$out" --recipe "$recipe" --tag "${recipe}_prefetch${pf}" \
      -- --dataloader_prefetch_factor "$pf"
  done
  python -m benchmarks.gpu.profile --out "$out" --recipe "$recipe" --tag "${recipe}_compiled" --steps 16 \
    --profile_from 12 -- --torch_compile
done
python - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
rows = [json.loads(p.read_text()) | {"tag": p.stem[8:]} for p in sorted(out.glob("profile_*.json"))]
lines = ["| run | step wall ms | kernel ms | GPU busy |", "|---|---|---|---|"]
lines += [f"| {r['tag']} | {r['step_wall_ms']} | {r['kernel_ms']} | {100 * r['busy']:.1f}% |" for r in rows]
(out / "busy.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY
