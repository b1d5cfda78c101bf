#!/usr/bin/env bash
# The main job: what a user does with Strata, end to end, in about 2.5 minutes on 2 cores (plus
# about 5 minutes, once per machine, for the Python environment).
#
#  1. Make a small chat model's directory: a byte-level BPE tokenizer trained with `tokenizers`
#     (ChatML chat template) and a Llama-3-style config.json (rope_scaling llama3, grouped-query
#     attention), plus 20000 conversations that teach a skill, reversing a list of digits
#     ("reverse: 3 1 4 1" -> "1 4 1 3"), and 200 held-out prompts (tools/skill_task.py).
#  2. `strata data prepare`: tokenize the JSONL with the model's own tokenizer and chat template;
#     only the assistant turns are trained.
#  3. `strata train` under `mpirun -np 2`: full AdamW, ZeRO stage 3 on 2 ranks of the CPU device,
#     parameters and optimizer states offloaded to NVMe (a directory under the build tree), packed
#     sequences of 256 tokens, 300 steps, one line per step; a Hugging Face checkpoint at the end.
#  4. transformers loads the checkpoint with its tokenizer and answers the 200 held-out prompts
#     with greedy generate; the job prints three of them and the accuracy.
#  5. `strata report`: report.html (loss curve, tokens/s, step-time split, NVMe bytes, memory).
#
#   ./deploy/main-job.sh [BUILD_DIR] [STEPS]
#
# Steps 1, 2 and 4 run in the Python environment deploy/hf-venv.sh makes (torch, transformers,
# tokenizers from PyPI: made once per machine, about 5 minutes and 5.9 GB; later runs reuse it).
# Everything the job writes goes to BUILD_DIR/main-job/ (default build/default/main-job/).
# deploy/synthetic-job.sh is the older main job: a 20M-parameter Llama on a synthetic token
# stream, which needs nothing but the build.
set -euo pipefail
cd "$(dirname "$0")/.."
build="${1:-build/default}"
steps="${2:-300}"
strata="$build/strata"
if [ ! -x "$strata" ]; then
  echo "main-job: $strata not found; build first (cmake --preset default && cmake --build --preset default)" >&2
  exit 2
fi
python="$(./deploy/hf-venv.sh "$build/hf-venv")"
out="$build/main-job"
# Emptied rather than removed, so that it may be a mount point (as in a container).
mkdir -p "$out"
find "$out" -mindepth 1 -delete
mkdir -p "$out/nvme"
out="$(cd "$out" && pwd)"

echo "main-job: [1/5] a chat model's tokenizer and config, and conversations that teach it to reverse lists"
"$python" tools/skill_task.py make "$out"

echo "main-job: [2/5] strata data prepare"
"$strata" data prepare --model "$out/model" --python "$python" \
  --input "$out/train-reverse.jsonl" --out "$out/reverse.stk"

cat > "$out/ds_config.json" <<JSON
{
  "train_micro_batch_size_per_gpu": 4,
  "gradient_accumulation_steps": 1,
  "gradient_clipping": 1.0,
  "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "betas": [0.9, 0.95], "weight_decay": 0.01}},
  "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 20, "total_num_steps": "auto"}},
  "zero_optimization": {
    "stage": 3,
    "offload_param": {"device": "nvme", "nvme_path": "$out/nvme"},
    "offload_optimizer": {"device": "nvme", "nvme_path": "$out/nvme"},
    "sub_group_size": 1000000
  }
}
JSON

echo "main-job: [3/5] strata train: ZeRO-3 on 2 ranks, parameters and optimizer states on NVMe"
mpi_args=(-np 2 --oversubscribe --bind-to none)
if [ "$(id -u)" = 0 ]; then mpi_args+=(--allow-run-as-root); fi
mpirun "${mpi_args[@]}" "$strata" train --config "$out/ds_config.json" --model "$out/model" \
  --data "$out/reverse.stk" --seq-len 256 --steps "$steps" --device cpu --save "$out/checkpoint" \
  --metrics "$out/metrics.jsonl" --trace "$out/trace.json"

echo "main-job: [4/5] transformers loads the checkpoint and answers 200 prompts it never saw"
"$python" tools/skill_task.py ask "$out/checkpoint/latest" "$out/held-reverse.jsonl" \
  --json "$out/accuracy.json"
# Far below the 200/200 it reaches, something is wrong: say so and fail.
"$python" -c '
import json, sys
a = json.load(open(sys.argv[1]))
if a["accuracy"] < 0.9:
    sys.exit("main-job: only %d/%d held-out prompts answered right (at least 90%% expected): "
             "the training did not learn the skill" % (a["correct"], a["total"]))
' "$out/accuracy.json"

echo "main-job: [5/5] strata report"
# With 2 ranks the trace is written per rank (trace.rank0.json, trace.rank1.json).
trace="$out/trace.json"
[ -f "$trace" ] || trace="$out/trace.rank0.json"
"$strata" report "$out/metrics.jsonl" --trace "$trace" --out "$out/report.html" \
  --title "Strata main job: a Llama-3-style chat model taught to reverse lists, ZeRO-3, NVMe offload, 2 ranks"
echo "main-job: done; the model: $out/checkpoint/latest (AutoModelForCausalLM and AutoTokenizer load it);"
echo "main-job: per-step metrics in $out/metrics.jsonl; the report: $out/report.html"
