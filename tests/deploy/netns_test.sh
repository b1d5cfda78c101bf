#!/usr/bin/env bash
# Two "machines" on one host: network namespaces strata_a and strata_b (each with its own host
# name) joined by a veth pair, 10.77.<n>.1 and 10.77.<n>.2. mpirun runs in strata_a and starts
# the second rank in strata_b through a launch agent (ip netns exec, in place of ssh), with Open
# MPI's TCP transport only (no shared memory), over the veth. Then:
#   1. the ZeRO equivalence tests (stage 3, every offload) on 2 ranks, one per namespace;
#   2. strata train, ZeRO-3 with parameters and optimizer on NVMe, whose losses must equal those
#      of the same run on one machine.
# Skips (77) without root or without network namespaces.
#
#   tests/deploy/netns_test.sh STRATA ZERO_MPI_TESTS WORK
set -euo pipefail
strata="$(realpath "$1")"
zero_tests="$(realpath "$2")"
work="$3"

[ "$(id -u)" = 0 ] || { echo "SKIP: network namespaces need root"; exit 77; }
command -v ip >/dev/null || { echo "SKIP: no ip (iproute2)"; exit 77; }
command -v mpirun >/dev/null || { echo "SKIP: no mpirun"; exit 77; }

n=$((RANDOM % 200 + 20))
a="strata_a$n" b="strata_b$n" va="sva$n" vb="svb$n"
ip_a="10.77.$n.1" ip_b="10.77.$n.2"
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
mkdir -p "$work/nvme-a" "$work/nvme-b" "$work/nvme-one"
work="$(cd "$work" && pwd)"
# The launch agent: Open MPI calls it as `agent HOST COMMAND...` where it would call ssh. It runs
# the command in HOST's namespace, under a host name of its own (so that Open MPI sees two nodes).
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
printf '%s slots=1\n%s slots=1\n' "$ip_a" "$ip_b" >"$work/hosts"

mpi=(mpirun --allow-run-as-root --hostfile "$work/hosts" -np 2 --map-by node --bind-to none
  --mca plm_rsh_agent "$work/agent.sh" --mca btl tcp,self --mca btl_tcp_if_include "10.77.$n.0/24"
  --mca oob_tcp_if_include "10.77.$n.0/24" -x OMPI_MCA_btl -x OPENBLAS_NUM_THREADS=1)
# mpirun itself runs in the first namespace, as its first node.
in_a=(ip netns exec "$a" unshare --uts sh -c 'hostname node-a; exec "$@"' sh)

echo "== where the ranks run"
"${in_a[@]}" "${mpi[@]}" sh -c 'echo "rank $OMPI_COMM_WORLD_RANK on $(hostname), local rank $OMPI_COMM_WORLD_LOCAL_RANK, $(ip -4 -o addr show | grep -o "10\.77\.[0-9.]*")"' |
  sort | tee "$work/where.txt"
grep -q "rank 0 on node-a, local rank 0, $ip_a" "$work/where.txt" || { echo "FAIL: rank 0 is not in $a"; exit 1; }
grep -q "rank 1 on node-b, local rank 0, $ip_b" "$work/where.txt" || { echo "FAIL: rank 1 is not in $b"; exit 1; }

echo "== the ZeRO-3 equivalence tests, one rank per namespace"
"${in_a[@]}" "${mpi[@]}" env STRATA_TEST_DIR="$work" "$zero_tests" --gtest_filter='EngineMpiTest.Stage3*' --gtest_color=no \
  --gtest_brief=1 >"$work/zero.out" 2>&1 || { tail -n 30 "$work/zero.out"; echo "FAIL: the ZeRO tests"; exit 1; }
grep -E "PASSED|FAILED" "$work/zero.out" | sort -u

echo "== strata train across the namespaces"
"$strata" data synth --out "$work/tokens.bin" --tokens 20k --vocab 256 >/dev/null
write_config() {
  cat >"$2" <<JSON
{"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.003}},
 "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "$1"},
   "offload_optimizer": {"device": "nvme", "nvme_path": "$1"}}}
JSON
}
# Each "machine" has its own NVMe directory: the rank's own path, chosen by its host name.
write_config "$work/nvme-a" "$work/ds-a.json"
sed "s|$work/nvme-a|$work/nvme-b|g" "$work/ds-a.json" >"$work/ds-b.json"
args=(--model llama-tiny --data "$work/tokens.bin" --seq-len 32 --steps 4 --device cpu)
"${in_a[@]}" "${mpi[@]}" sh -c 'c='"$work"'/ds-a.json; [ "$(hostname)" = node-b ] && c='"$work"'/ds-b.json; exec "$0" train --config "$c" "$@" --metrics '"$work"'/net.$(hostname).jsonl' \
  "$strata" "${args[@]}" >"$work/net.out" 2>&1 || { tail -n 20 "$work/net.out"; echo "FAIL: strata train"; exit 1; }
grep -q "2 rank(s)" "$work/net.out" || { echo "FAIL: strata train did not see 2 ranks"; exit 1; }
write_config "$work/nvme-one" "$work/ds-one.json"
mpirun --allow-run-as-root --oversubscribe -np 2 --bind-to none "$strata" train --config "$work/ds-one.json" \
  "${args[@]}" --metrics "$work/one.jsonl" >"$work/one.out" 2>&1 || { tail -n 20 "$work/one.out"; echo "FAIL: the one-machine run"; exit 1; }
python3 - "$work/net.node-a.jsonl" "$work/one.jsonl" <<'PY'
import json, sys
a = [json.loads(l)["loss"] for l in open(sys.argv[1])]
b = [json.loads(l)["loss"] for l in open(sys.argv[2])]
print(f"losses across the namespaces {a}\nlosses on one machine        {b}")
sys.exit(0 if a == b and len(a) == 4 else 1)
PY
echo "== ZeRO++ qwZ across the namespaces: the same run with zero_quantized_weights"
sed 's|"stage": 3,|"stage": 3, "zero_quantized_weights": true,|' "$work/ds-a.json" >"$work/qwz-a.json"
sed 's|"stage": 3,|"stage": 3, "zero_quantized_weights": true,|' "$work/ds-b.json" >"$work/qwz-b.json"
grep -q zero_quantized_weights "$work/qwz-a.json" || { echo "FAIL: could not write the qwZ config"; exit 1; }
"${in_a[@]}" "${mpi[@]}" sh -c 'c='"$work"'/qwz-a.json; [ "$(hostname)" = node-b ] && c='"$work"'/qwz-b.json; exec "$0" train --config "$c" "$@" --metrics '"$work"'/qwz.$(hostname).jsonl' \
  "$strata" "${args[@]}" >"$work/qwz.out" 2>&1 || { tail -n 20 "$work/qwz.out"; echo "FAIL: strata train with qwZ"; exit 1; }
grep -q "sent node .* across" "$work/qwz.out" || { echo "FAIL: the step line does not report the traffic"; exit 1; }
python3 - "$work/net.node-a.jsonl" "$work/qwz.node-a.jsonl" <<'PY'
import json, sys
plain = [json.loads(l) for l in open(sys.argv[1])]
qwz = [json.loads(l) for l in open(sys.argv[2])]
ok = len(qwz) == 4
for name, run in (("plain", plain), ("qwZ", qwz)):
    last = run[-1]
    print(f"{name:5}: bytes rank 0 sent across the nodes in step 4: "
          f"forward gathers {last['net_inter_bytes_forward_gathers']}, "
          f"backward gathers {last['net_inter_bytes_backward_gathers']}, "
          f"reductions {last['net_inter_bytes_gradient_reductions']}, all {last['net_inter_bytes']}; "
          f"within the node {last['net_intra_bytes']}; losses {[round(r['loss'], 4) for r in run]}")
    ok = ok and last["net_intra_bytes"] == 0 and last["net_inter_bytes"] > 0
# fp32 compute: each gathered element was 4 bytes and is 1 + 4/2048 with qwZ. (llama-tiny's
# units are all under stage3_param_persistence_threshold: gathered once in forward, kept for
# backward, so backward gathers nothing.)
ok = ok and plain[-1]["net_inter_bytes_forward_gathers"] > 0
for key in ("net_inter_bytes_forward_gathers", "net_inter_bytes_backward_gathers"):
    if plain[-1][key] == 0:
        ok = ok and qwz[-1][key] == 0
        continue
    ratio = qwz[-1][key] / plain[-1][key]
    print(f"{key}: qwZ / plain = {ratio:.6f} (expected {(1 + 4 / 2048) / 4:.6f})")
    ok = ok and abs(ratio - (1 + 4 / 2048) / 4) < 1e-9
ok = ok and all(abs(a["loss"] - b["loss"]) <= 0.05 * abs(a["loss"]) for a, b in zip(plain, qwz))
sys.exit(0 if ok else 1)
PY
echo "netns_test: passed"
