#!/usr/bin/env bash
# The synthetic job (the main job until December 2026; it needs nothing but the build): a Llama
# of about 20M parameters (preset llama-20m) trained with ZeRO stage 3 on 2 MPI ranks of the CPU
# device, parameters and optimizer states offloaded to NVMe (a directory under the build tree), on
# a synthetic Markov corpus the project generates, for 300 steps; it ends with a Hugging Face
# checkpoint and report.html. About 5 minutes on a 2-core machine. Its 300 losses and saved
# files are the bit-for-bit reference of refactorings ("no behaviour change"); its final loss
# depends on the machine (README, "The synthetic job"). The Docker image runs it.
#
#   ./deploy/synthetic-job.sh [BUILD_DIR] [STEPS]
#
# Everything it writes goes to BUILD_DIR/synthetic-job/ (default build/default/synthetic-job/).
set -euo pipefail
cd "$(dirname "$0")/.."
build="${1:-build/default}"
steps="${2:-300}"
strata="$build/strata"
if [ ! -x "$strata" ]; then
  echo "synthetic-job: $strata not found; build first (cmake --preset default && cmake --build --preset default)" >&2
  exit 2
fi
out="$build/synthetic-job"
rm -rf "$out/nvme"
mkdir -p "$out/nvme"
out="$(cd "$out" && pwd)"

"$strata" data synth --out "$out/tokens.bin" --tokens 4M --vocab 1024 --seed 1

cat > "$out/ds_config.json" <<JSON
{
  "train_micro_batch_size_per_gpu": 4,
  "gradient_accumulation_steps": 1,
  "gradient_clipping": 1.0,
  "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
  "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 20, "total_num_steps": "auto"}},
  "bf16": {"enabled": true},
  "zero_optimization": {
    "stage": 3,
    "offload_param": {"device": "nvme", "nvme_path": "$out/nvme"},
    "offload_optimizer": {"device": "nvme", "nvme_path": "$out/nvme", "buffer_count": 8},
    "sub_group_size": 1000000
  }
}
JSON

mpi_args=(-np 2 --oversubscribe --bind-to none)
if [ "$(id -u)" = 0 ]; then mpi_args+=(--allow-run-as-root); fi
mpirun "${mpi_args[@]}" "$strata" train --config "$out/ds_config.json" --model llama-20m \
  --data "$out/tokens.bin" --seq-len 64 --steps "$steps" --device cpu --save "$out/checkpoint" \
  --metrics "$out/metrics.jsonl" --trace "$out/trace.json"
# With 2 ranks the trace is written per rank (trace.rank0.json, trace.rank1.json).
trace="$out/trace.json"
[ -f "$trace" ] || trace="$out/trace.rank0.json"
"$strata" report "$out/metrics.jsonl" --trace "$trace" --out "$out/report.html" \
  --title "Strata synthetic job: llama-20m, ZeRO-3, NVMe offload, 2 ranks"
echo "synthetic-job: done; per-step metrics in $out/metrics.jsonl; the report: $out/report.html"
