#!/usr/bin/env bash
# deploy/slurm/strata-train.sbatch on a real single-node Slurm: this script starts munged,
# slurmctld and slurmd (Debian's munge and slurm-wlm) on private sockets and ports under WORK,
# submits the script with sbatch --wait for 2 tasks (ZeRO-3, parameters and optimizer on NVMe, the
# CPU device), and checks that the job trained on 2 ranks with every rank placed by Slurm, that its
# per-job NVMe directory was made and removed, and that its losses equal those of the same run
# under mpirun. Skips (77) without root or without the Slurm and munge daemons.
#
#   tests/deploy/slurm_test.sh STRATA WORK
set -euo pipefail
strata="$(realpath "$1")"
work="$2"
root="$(cd "$(dirname "$0")/../.." && pwd)"

[ "$(id -u)" = 0 ] || { echo "SKIP: starting slurmd needs root"; exit 77; }
for b in munged slurmctld slurmd sbatch sinfo; do
  command -v "$b" >/dev/null || { echo "SKIP: $b not found (deploy/install-deps.sh installs slurm-wlm and munge)"; exit 77; }
done

rm -rf "$work"
mkdir -p "$work"/{munge,state,spool,log,nvme,nvme-mpi}
work="$(cd "$work" && pwd)"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  [ -f "$work/munge/pid" ] && kill "$(cat "$work/munge/pid")" 2>/dev/null || true
  wait 2>/dev/null || true
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; for f in "$work"/log/*.log "$work"/*.out; do [ -f "$f" ] && { echo "--- $f"; tail -n 20 "$f"; }; done; exit 1; }

# munge, on its own socket and key.
dd if=/dev/urandom of="$work/munge/key" bs=1024 count=1 status=none
chmod 400 "$work/munge/key"
munged --force --socket="$work/munge/sock" --key-file="$work/munge/key" \
  --pid-file="$work/munge/pid" --log-file="$work/log/munged.log" --seed-file="$work/munge/seed" ||
  fail "munged did not start"

host="$(hostname)"
port=$((20000 + RANDOM % 20000))
export SLURM_CONF="$work/slurm.conf"
cat >"$SLURM_CONF" <<CONF
ClusterName=stratatest
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$work/munge/sock
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
StateSaveLocation=$work/state
SlurmdSpoolDir=$work/spool
SlurmctldPidFile=$work/slurmctld.pid
SlurmdPidFile=$work/slurmd.pid
SlurmctldLogFile=$work/log/slurmctld.log
SlurmdLogFile=$work/log/slurmd.log
SlurmctldPort=$port
SlurmdPort=$((port + 1))
NodeName=$host CPUs=$(nproc) State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
slurmctld -D -f "$SLURM_CONF" >"$work/log/slurmctld.out" 2>&1 &
pids+=($!)
slurmd -D -f "$SLURM_CONF" >"$work/log/slurmd.out" 2>&1 &
pids+=($!)
for _ in $(seq 60); do
  [ "$(sinfo -h -o %T 2>/dev/null)" = idle ] && break
  sleep 0.5
done
[ "$(sinfo -h -o %T 2>/dev/null)" = idle ] || fail "the node did not come up idle ($(sinfo -h -o %T 2>&1))"
echo "slurm: node $host idle (ports $port, $((port + 1)))"

"$strata" data synth --out "$work/tokens.bin" --tokens 20k --vocab 256 >/dev/null
cat >"$work/ds.json" <<'JSON'
{"train_micro_batch_size_per_gpu": 2,
 "optimizer": {"type": "AdamW", "params": {"lr": 0.003}},
 "zero_optimization": {"stage": 3,
   "offload_param": {"device": "nvme", "nvme_path": "@NVME_DIR@"},
   "offload_optimizer": {"device": "nvme", "nvme_path": "@NVME_DIR@"}}}
JSON
args=(--seq-len 32 --steps 4)
cd "$work"
STRATA="$strata" STRATA_NVME_ROOT="$work/nvme" STRATA_DEVICE=cpu \
  sbatch --wait --nodes=1 --ntasks=2 --output="$work/job-%j.out" \
  "$root/deploy/slurm/strata-train.sbatch" "$work/ds.json" llama-tiny "$work/tokens.bin" \
  "${args[@]}" --metrics "$work/slurm.jsonl" >"$work/sbatch.out" 2>&1 ||
  fail "sbatch --wait: $(cat "$work/sbatch.out")"
out="$(ls "$work"/job-*.out)"
cat "$out"
grep -q "2 tasks on 1 node" "$out" || fail "the job did not run 2 tasks"
grep -q "2 rank(s)" "$out" || fail "strata train did not see 2 ranks"
grep -q "nvme r" "$out" || fail "no step lines"
[ -z "$(ls -A "$work/nvme")" ] || fail "the job's NVMe directory was not removed: $(ls "$work/nvme")"

# The same run under mpirun: the same losses, bit for bit.
sed "s|@NVME_DIR@|$work/nvme-mpi|g" "$work/ds.json" >"$work/ds-mpi.json"
mpirun -np 2 --oversubscribe --allow-run-as-root --bind-to none "$strata" train \
  --config "$work/ds-mpi.json" --model llama-tiny --data "$work/tokens.bin" --device cpu \
  "${args[@]}" --metrics "$work/mpi.jsonl" >"$work/mpi.out" 2>&1 || fail "mpirun: $(tail -5 "$work/mpi.out")"
python3 - "$work/slurm.jsonl" "$work/mpi.jsonl" <<'PY' || fail "losses differ"
import json, sys
a = [json.loads(l)["loss"] for l in open(sys.argv[1])]
b = [json.loads(l)["loss"] for l in open(sys.argv[2])]
print(f"losses under srun {a}\nlosses under mpirun {b}")
sys.exit(0 if a == b and len(a) == 4 else 1)
PY
echo "slurm_test: passed"
