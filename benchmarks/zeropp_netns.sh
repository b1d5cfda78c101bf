#!/usr/bin/env bash
# ZeRO++ across two "machines": 2 nodes x 2 ranks, each node a network namespace with its own host
# name, joined by a veth pair; Open MPI's TCP transport only. The main job's model and config
# (deploy/main-job.sh: the Llama-3-style chat model taught to reverse lists, ZeRO-3, parameters
# and optimizer on NVMe) trains three times for STEPS steps:
#
#   plain    ZeRO-3 as the main job runs it
#   zeropp   the same with zero_quantized_weights, zero_hpz_partition_size 2 and
#            zero_quantized_gradients
#   one      plain again, but all 4 ranks on one machine (shared memory): the same bits as
#            "plain" shows that the topology and the counters change nothing when the features
#            are off
#
# and prints JSON and a short table: the bytes rank 0 sent across nodes per step (from the
# engine's traffic counters, per phase), the loss after STEPS steps and over all of them, the
# held-out prompts each trained model answers (as the main job asks them, through transformers),
# and the targets: cross-node bytes with ZeRO++ at most 0.3x plain's; its final loss within 1%
# of plain's (where both runs have learned the task and their losses are near zero, that ratio
# is noise, and the held-out answers decide instead: at least plain's, less 1%); "one" equal to
# "plain" bit for bit. Exits 1 when a target is missed. Needs root (network namespaces) and the
# Python environment of deploy/hf-venv.sh (the model's tokenizer). About 8 minutes on 2 cores at
# 300 steps.
#
#   benchmarks/zeropp_netns.sh [BUILD_DIR] [STEPS] [WORK] [MODE]
#
# MODE "full" (the default) checks every target; "bytes" (ctest zeropp_netns_bytes, a short run)
# checks the byte ratio and the bits with everything off only, and asks no prompts. Exits 77
# (skipped) without root or network namespaces.
set -euo pipefail
cd "$(dirname "$0")/.."
build="${1:-build/default}"
steps="${2:-300}"
work="${3:-$build/zeropp-netns}"
mode="${4:-full}"
strata="$(realpath "$build/strata")"
[ -x "$strata" ] || { echo "zeropp_netns: $strata not found; build first" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "SKIP: network namespaces need root"; exit 77; }
command -v ip >/dev/null || { echo "SKIP: no ip (iproute2)"; exit 77; }
python="$(./deploy/hf-venv.sh "$build/hf-venv")"

n=$((RANDOM % 200 + 20))
a="zpp_a$n" b="zpp_b$n" va="zva$n" vb="zvb$n"
ip_a="10.78.$n.1" ip_b="10.78.$n.2"
cleanup() {
  ip netns del "$a" 2>/dev/null || true
  ip netns del "$b" 2>/dev/null || true
}
trap cleanup EXIT
ip netns add "$a" 2>/dev/null || { echo "SKIP: cannot create a network namespace here"; exit 77; }
ip netns add "$b"
ip link add "$va" type veth peer name "$vb"
ip link set "$va" netns "$a"
ip link set "$vb" netns "$b"
ip -n "$a" addr add "$ip_a/24" dev "$va"
ip -n "$b" addr add "$ip_b/24" dev "$vb"
for ns in "$a" "$b"; do ip -n "$ns" link set lo up; done
ip -n "$a" link set "$va" up
ip -n "$b" link set "$vb" up

rm -rf "$work"
mkdir -p "$work"
work="$(cd "$work" && pwd)"
cat >"$work/agent.sh" <<AGENT
#!/usr/bin/env bash
host="\$1"; shift
case "\$host" in
  $ip_a) ns=$a; name=node-a ;;
  $ip_b) ns=$b; name=node-b ;;
  *) echo "agent: unknown host \$host" >&2; exit 1 ;;
esac
exec ip netns exec "\$ns" unshare --uts sh -c "hostname \$name; \$*"
AGENT
chmod +x "$work/agent.sh"
printf '%s slots=2\n%s slots=2\n' "$ip_a" "$ip_b" >"$work/hosts"
mpi=(mpirun --allow-run-as-root --hostfile "$work/hosts" -np 4 --map-by slot --bind-to none
  --mca plm_rsh_agent "$work/agent.sh" --mca btl tcp,self --mca btl_tcp_if_include "10.78.$n.0/24"
  --mca oob_tcp_if_include "10.78.$n.0/24" -x OPENBLAS_NUM_THREADS=1)
in_a=(ip netns exec "$a" unshare --uts sh -c 'hostname node-a; exec "$@"' sh)

echo "zeropp_netns: the main job's model and data"
"$python" tools/skill_task.py make "$work" >/dev/null
"$strata" data prepare --model "$work/model" --python "$python" \
  --input "$work/train-reverse.jsonl" --out "$work/reverse.stk" >/dev/null

# The main job's config (deploy/main-job.sh) as it was for the measurement in docs/benchmarks.md
# (lr 3e-3; the main job now trains at 2e-3), its NVMe directory per node (by host name), and
# ZeRO++'s keys for the second run.
write_config() {  # NVME_DIR EXTRA OUT
  mkdir -p "$1"
  cat >"$3" <<JSON
{
  "train_micro_batch_size_per_gpu": 4,
  "gradient_accumulation_steps": 1,
  "gradient_clipping": 1.0,
  "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.01}},
  "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 20, "total_num_steps": "auto"}},
  "zero_optimization": {
    "stage": 3,$2
    "offload_param": {"device": "nvme", "nvme_path": "$1"},
    "offload_optimizer": {"device": "nvme", "nvme_path": "$1"},
    "sub_group_size": 1000000
  }
}
JSON
}
zeropp='
    "zero_quantized_weights": true, "zero_hpz_partition_size": 2, "zero_quantized_gradients": true,'
for node in node-a node-b; do
  write_config "$work/nvme-plain-$node" "" "$work/plain.$node.json"
  write_config "$work/nvme-zeropp-$node" "$zeropp" "$work/zeropp.$node.json"
done
write_config "$work/nvme-one" "" "$work/one.json"
args=(--model "$work/model" --data "$work/reverse.stk" --seq-len 256 --steps "$steps" --device cpu)

for run in plain zeropp; do
  echo "zeropp_netns: $run, 2 nodes x 2 ranks, $steps steps"
  start=$(date +%s)
  "${in_a[@]}" "${mpi[@]}" sh -c 'exec "$0" train --config '"$work/$run"'.$(hostname).json "$@" --metrics '"$work/$run"'.$(hostname).$OMPI_COMM_WORLD_LOCAL_RANK.jsonl' \
    "$strata" "${args[@]}" --save "$work/checkpoint-$run" >"$work/$run.out" 2>&1 || { tail -n 20 "$work/$run.out"; echo "zeropp_netns: $run failed" >&2; exit 1; }
  echo $(( $(date +%s) - start )) >"$work/$run.seconds"
  grep -q "4 rank(s) on 2 node(s) x 2 rank(s)" "$work/$run.out" || { tail -n 20 "$work/$run.out"; echo "zeropp_netns: $run did not see 2 nodes of 2 ranks" >&2; exit 1; }
done
echo "zeropp_netns: plain, 4 ranks on one machine, $steps steps"
start=$(date +%s)
mpirun --allow-run-as-root --oversubscribe -np 4 --bind-to none -x OPENBLAS_NUM_THREADS=1 \
  "$strata" train --config "$work/one.json" "${args[@]}" --metrics "$work/one.jsonl" \
  >"$work/one.out" 2>&1 || { tail -n 20 "$work/one.out"; echo "zeropp_netns: the one-machine run failed" >&2; exit 1; }
echo $(( $(date +%s) - start )) >"$work/one.seconds"

# What the main job measures: the trained model, loaded by transformers, answers the 200
# held-out prompts.
for run in plain zeropp; do
  [ "$mode" = full ] || break
  echo "zeropp_netns: transformers asks $run's model the held-out prompts"
  "$python" tools/skill_task.py ask "$work/checkpoint-$run/latest" "$work/held-reverse.jsonl" \
    --json "$work/accuracy-$run.json" >"$work/ask-$run.out" 2>&1 || { tail -n 20 "$work/ask-$run.out"; exit 1; }
done

python3 - "$work" "$steps" "$mode" <<'PY'
import json, os, sys
work, steps, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def load(path):
    return [json.loads(l) for l in open(path)]
plain = load(f"{work}/plain.node-a.0.jsonl")
zeropp = load(f"{work}/zeropp.node-a.0.jsonl")
one = load(f"{work}/one.jsonl")
def per_step(run, key):  # --metrics reports each step's own bytes: the last step's
    return run[-1][key]
phases = ["forward_gathers", "backward_gathers", "gradient_reductions"]
out = {"steps": steps, "topology": "2 nodes x 2 ranks (network namespaces, TCP)", "runs": {}}
for name, run in (("plain", plain), ("zeropp", zeropp)):
    path = f"{work}/accuracy-{name}.json"
    acc = json.load(open(path)) if os.path.exists(path) else {"correct": 0, "total": 0}
    r = {"final_loss": run[-1]["loss"],
         "mean_loss": sum(s["loss"] for s in run) / len(run),
         "held_out_correct": acc["correct"], "held_out_total": acc["total"],
         "seconds": int(open(f"{work}/{name}.seconds").read()),
         "inter_bytes_per_step": per_step(run, "net_inter_bytes"),
         "intra_bytes_per_step": per_step(run, "net_intra_bytes")}
    for p in phases:
        r[f"inter_bytes_per_step_{p}"] = per_step(run, f"net_inter_bytes_{p}")
    out["runs"][name] = r
p, z = out["runs"]["plain"], out["runs"]["zeropp"]
out["inter_bytes_ratio"] = z["inter_bytes_per_step"] / p["inter_bytes_per_step"]
out["final_loss_relative_difference"] = abs(z["final_loss"] - p["final_loss"]) / abs(p["final_loss"])
out["final_loss_absolute_difference"] = abs(z["final_loss"] - p["final_loss"])
out["mean_loss_relative_difference"] = abs(z["mean_loss"] - p["mean_loss"]) / abs(p["mean_loss"])
out["off_equals_one_machine"] = [s["loss"] for s in plain] == [s["loss"] for s in one]
out["targets"] = {"inter_bytes_ratio_max": 0.3, "final_loss_relative_difference_max": 0.01}
# The loss target as the issue states it. When both runs have learned the task (final losses
# near zero) a relative difference of two values near zero measures noise, not quality: then
# the held-out answers decide (ZeRO++ must answer at least as many as plain, less 1%).
loss_literal = out["final_loss_relative_difference"] <= 0.01
converged = p["final_loss"] < 0.01 and z["final_loss"] < 0.01
quality = z["held_out_correct"] >= p["held_out_correct"] - 0.01 * p["held_out_total"]
out["loss_target_literal_met"] = loss_literal
out["both_converged"] = converged
out["held_out_as_good"] = quality
ok = (out["inter_bytes_ratio"] <= 0.3 and out["off_equals_one_machine"]
      and len(zeropp) == steps and len(plain) == steps)
if mode == "full":
    ok = ok and (loss_literal or (converged and quality))
out["passed"] = ok
print(json.dumps(out, indent=1))
print()
print(f"{'bytes rank 0 sent across nodes per step':42} {'plain':>12} {'ZeRO++':>12} {'ratio':>7}")
for key, label in [("inter_bytes_per_step_forward_gathers", "forward gathers"),
                   ("inter_bytes_per_step_backward_gathers", "backward gathers"),
                   ("inter_bytes_per_step_gradient_reductions", "gradient reductions"),
                   ("inter_bytes_per_step", "all")]:
    ratio = z[key] / p[key] if p[key] else float("nan")
    print(f"  {label:40} {p[key]:12,} {z[key]:12,} {ratio:7.3f}")
print(f"{'loss after ' + str(steps) + ' steps':42} {p['final_loss']:12.6f} {z['final_loss']:12.6f} "
      f"{out['final_loss_relative_difference']:7.2%}")
print(f"{'mean loss over the ' + str(steps) + ' steps':42} {p['mean_loss']:12.4f} {z['mean_loss']:12.4f} "
      f"{out['mean_loss_relative_difference']:7.2%}")
print(f"{'held-out prompts answered right':42} {p['held_out_correct']:>8}/{p['held_out_total']} "
      f"{z['held_out_correct']:>8}/{z['held_out_total']}")
print(f"{'seconds':42} {p['seconds']:12} {z['seconds']:12}")
print(f"all features off, across the namespaces, equals 4 ranks on one machine bit for bit: "
      f"{out['off_equals_one_machine']}")
print("zeropp_netns:", "targets met" if ok else "TARGET MISSED")
sys.exit(0 if ok else 1)
PY
