#!/usr/bin/env bash
# ZeRO++ under strata train with the units the toy model of the in-process tests lacks: LoRA
# (adapter units that read the block before them, frozen base units) and split blocks with
# activation checkpointing (units gathered again to recompute). 4 ranks under mpirun, made 2 nodes
# x 2 ranks by STRATA_NODE_NAME. For each: plain ZeRO-3 and hpZ give the same losses bit for bit
# and hpZ's backward gathers send nothing across nodes; all three features on train within 5% of
# plain over 4 steps.
#
#   tests/train/zeropp_ranks.sh STRATA WORK
set -euo pipefail
strata="$(realpath "$1")"
work="$2"
rm -rf "$work"
mkdir -p "$work"
cd "$work"
"$strata" data synth --out tokens.bin --tokens 20k --vocab 256 >/dev/null
mpi=(mpirun --oversubscribe -np 4 --bind-to none -x OPENBLAS_NUM_THREADS=1)
if [ "$(id -u)" = 0 ]; then mpi+=(--allow-run-as-root); fi

run() {  # NAME STRATA_SECTION ZERO_EXTRA
  cat >"$1.json" <<JSON
{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
 "optimizer": {"type": "AdamW", "params": {"lr": 0.003}},
 "strata": {$2},
 "zero_optimization": {"stage": 3, $3 "stage3_param_persistence_threshold": 0}}
JSON
  "${mpi[@]}" sh -c 'STRATA_NODE_NAME=node-$((OMPI_COMM_WORLD_RANK / 2)) exec "$0" "$@"' \
    "$strata" train --config "$1.json" --model llama-tiny --data tokens.bin --seq-len 32 --steps 4 \
    --device cpu --metrics "$1.jsonl" >"$1.out" 2>&1 || { tail -n 20 "$1.out"; echo "FAIL: $1"; exit 1; }
  grep -q "4 rank(s) on 2 node(s) x 2 rank(s)" "$1.out" || { head -3 "$1.out"; echo "FAIL: $1 did not see 2 nodes"; exit 1; }
}

all='"zero_quantized_weights": true, "zero_hpz_partition_size": 2, "zero_quantized_gradients": true,'
for kind in lora split; do
  case $kind in
    lora) section='"lora": {"r": 4, "target_modules": "all-linear"}' ;;
    split) section='"split_blocks": true, "activation_checkpointing": true' ;;
  esac
  run "$kind-plain" "$section" ""
  run "$kind-hpz" "$section" '"zero_hpz_partition_size": 2,'
  run "$kind-all" "$section" "$all"
  python3 - "$kind" <<'PY'
import json, sys
kind = sys.argv[1]
load = lambda run: [json.loads(l) for l in open(f"{kind}-{run}.jsonl")]
plain, hpz, every = load("plain"), load("hpz"), load("all")
losses = lambda r: [s["loss"] for s in r]
print(f"{kind}: plain {[round(x, 5) for x in losses(plain)]}, hpZ {[round(x, 5) for x in losses(hpz)]}, "
      f"all three {[round(x, 5) for x in losses(every)]}")
back = lambda r: r[-1]["net_inter_bytes_backward_gathers"]
print(f"{kind}: backward gathers across nodes: plain {back(plain)}, hpZ {back(hpz)}, all three {back(every)}")
ok = len(plain) == len(hpz) == len(every) == 4
ok = ok and losses(plain) == losses(hpz) and back(plain) > 0 and back(hpz) == 0 and back(every) == 0
ok = ok and all(abs(a - b) <= 0.05 * abs(a) for a, b in zip(losses(plain), losses(every)))
sys.exit(0 if ok else 1)
PY
done
echo "zeropp_ranks: passed"
