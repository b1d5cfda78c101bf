#!/usr/bin/env bash
# The GPU check's steps and their order (docs/gpu.md, "Time budget"), on any machine: no GPU, no
# CUDA build, no carry folder needed.
#   1. `deploy/gpu-check.sh --dry-run` lists:
#      - run: the tests, then the attention benchmarks with Strata's own kernels
#        (STRATA_ATTENTION=kernels) after the main ones; no micro-benchmark step, and a line saying
#        they run only with --micro; default budget 130 s;
#      - run --micro: the micro-benchmark steps after the attention ones; default budget 300 s;
#      - run --train: train_hbm first, then the CPU-optimizer and NVMe scenarios, each after the
#        steps whose numbers it takes; nvme at 2 steps; default budget 410 s; the 8B run
#        (train_largest) last, and only with --largest;
#      - --micro with --train or --no-bench is refused; --budget is kept.
#   2. `run`, `run --micro` and `run --train` against a carry folder of stub binaries (which answer
#      at once, or fail) take their steps in that order, as steps.tsv records them.
# Also run by tests/deploy/gpu_check_test.sh.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
check="$root/deploy/gpu-check.sh"
fail() {
  echo "gpu_check_steps_test: $*" >&2
  exit 1
}

# The step names in a text, in order of first appearance.
steps_of() {
  sed 's/test_<executable>/test_EXECUTABLE/g' |
    grep -oE '\b(env|env_json|info_nvidia_smi|test_[A-Za-z_]+|attention_(strata|pytorch)(_kernels)?_d[0-9]+|copy_(strata|pytorch)|adam_(strata|pytorch)|checksum_cost|overlap_L[0-9]+|cpu_adam_rate|deepspeed_env|nvme_rate|train_(hbm|cpu_optim|nvme|largest))\b' |
    awk '!seen[$0]++'
}
# LIST on one line, for messages.
flat() {
  printf '%s\n' "$1" | paste -sd' ' -
}
# index_of NAME LIST: NAME's line number in LIST (0 when absent).
index_of() {
  printf '%s\n' "$2" | awk -v n="$1" '$0 == n { print NR; found = 1; exit } END { if (!found) print 0 }'
}
# before A B LIST: both are listed, A before B.
before() {
  local a b
  a="$(index_of "$1" "$3")"
  b="$(index_of "$2" "$3")"
  [ "$a" -gt 0 ] || fail "$1 is not listed: $(flat "$3")"
  [ "$b" -gt 0 ] || fail "$2 is not listed: $(flat "$3")"
  [ "$a" -lt "$b" ] || fail "$1 is not before $2: $(flat "$3")"
}
# The check phase's order: tests, attention, Strata's own kernels after both main shapes.
check_order() {
  local steps="$1"
  before "$(grep -m1 '^test_' <<<"$steps" || echo test_)" attention_strata_d64 "$steps"
  before attention_strata_d64 attention_pytorch_d64 "$steps"
  before attention_pytorch_d64 attention_strata_d128 "$steps"
  before attention_pytorch_d128 attention_strata_kernels_d64 "$steps"
  before attention_strata_kernels_d64 attention_strata_kernels_d128 "$steps"
}
no_micro() {
  if grep -E '^(copy_|adam_|checksum_cost|overlap_)' <<<"$1"; then
    fail "$2 lists micro-benchmark steps without --micro: $(flat "$1")"
  fi
}
micro_after_attention() {
  local s
  for s in copy_strata copy_pytorch adam_strata adam_pytorch checksum_cost; do
    before attention_strata_kernels_d128 "$s" "$1"
  done
  before checksum_cost "$(grep -m1 '^overlap_L' <<<"$1" || echo overlap_L)" "$1"
}
# The training phase's order: hbm first, each step after the numbers it takes.
train_order() {
  local steps="$1" first
  first="$(grep -E '^(train_|copy_|cpu_adam_rate|deepspeed_env|nvme_rate)' <<<"$steps" | sed -n 1p)"
  [ "$first" = train_hbm ] || fail "run --train does not start with train_hbm: $(flat "$steps")"
  before train_hbm cpu_adam_rate "$steps"
  before cpu_adam_rate train_cpu_optim "$steps"
  before train_cpu_optim train_nvme "$steps"
  before copy_strata train_nvme "$steps"
  before nvme_rate train_nvme "$steps"
}

# ---- 1. the dry-runs
out="$("$check" --dry-run)"
grep -q "budget 130 s" <<<"$out" || fail "run's default budget is not 130 s"
grep -q -- "--gtest_filter='\*Gpu\*'" <<<"$out" || fail "run does not list the GPU tests"
grep -qi "skipped.*only with --micro" <<<"$out" ||
  fail "run's dry-run does not say that the micro-benchmarks run only with --micro"
grep -q "STRATA_ATTENTION=kernels" <<<"$out" || fail "run does not name STRATA_ATTENTION=kernels"
steps="$(steps_of <<<"$out")"
no_micro "$steps" "run's dry-run"
check_order "$steps"

out="$("$check" run --micro --dry-run)"
grep -q "budget 300 s" <<<"$out" || fail "run --micro's default budget is not 300 s"
micro_after_attention "$(steps_of <<<"$out")"
out="$("$check" run --micro --budget 420 --dry-run)"
grep -q "budget 420 s" <<<"$out" || fail "--budget 420 is not kept"

out="$("$check" run --train --dry-run)"
grep -q "budget 410 s" <<<"$out" || fail "run --train's default budget is not 410 s"
steps="$(steps_of <<<"$out")"
train_order "$steps"
before train_hbm deepspeed_env "$steps"
before deepspeed_env train_cpu_optim "$steps"
grep -q -- "--scenarios nvme, 2 steps" <<<"$out" || fail "run --train's nvme is not 2 steps"
grep -q "2048 tokens (off)" <<<"$out" || fail "run --train's dry-run does not say the 8B run is off"
out="$("$check" run --train --largest --dry-run)"
grep -q "(on: --largest)" <<<"$out" || fail "run --train --largest's dry-run does not say the 8B run is on"

for bad in "run --train --micro" "run --no-bench --micro" "run --largest"; do
  # shellcheck disable=SC2086  # the words of $bad are the options
  if "$check" $bad --dry-run >/dev/null 2>&1; then
    fail "'$bad' was accepted"
  fi
done

# ---- 2. the steps a run takes, with stub binaries
tmp="$(mktemp -d)"  # the stubs, logs and outputs (KEEP=1 keeps them)
trap '[ -n "${KEEP:-}" ] || rm -rf "$tmp"' EXIT
carry="$tmp/carry"
mkdir -p "$carry/bin" "$carry/lib" "$carry/lib-fallback"
cat >"$carry/manifest.json" <<'EOF'
{"commit": "stub", "runtime_libs": [], "binaries": ["strata", "strata_gpu_bench", "strata_stub_tests"],
 "deepspeed": "not carried: stub", "gpu_test_executables": {"strata_stub_tests": 1}}
EOF
cat >"$carry/bin/strata" <<'EOF'
#!/bin/sh
case "$1 $2" in
  "env --json") echo '{"gpu": {"devices": [], "none_reason": "stub"}}' ;;
  "env "*) echo "stub strata env" ;;
  estimate*) echo '{"hardware": {"cpu_adam_params_per_s": 2e9}}' ;;
  nvme-bench*) echo '{"results": [{"phases": [{"op": "read", "gb_per_s": 1.5}, {"op": "write", "gb_per_s": 2.5}]}]}' ;;
  *) echo "stub strata: $*" >&2; exit 1 ;;
esac
EOF
cat >"$carry/bin/strata_gpu_bench" <<'EOF'
#!/bin/sh
echo "stub strata_gpu_bench: $* (STRATA_ATTENTION=${STRATA_ATTENTION:-})" >&2
exit 1
EOF
cat >"$carry/bin/strata_stub_tests" <<'EOF'
#!/bin/sh
for a in "$@"; do
  case "$a" in
    --gtest_list_tests) exit 0 ;;
    --gtest_output=xml:*) xml="${a#--gtest_output=xml:}" ;;
  esac
done
echo '<testsuites><testsuite><testcase classname="StubGpuTest" name="A"/></testsuite></testsuites>' >"$xml"
EOF
chmod +x "$carry"/bin/*
# stubbed_run NAME ARGS...: gpu-check run ARGS against the stubs; prints the steps it took.
stubbed_run() {
  local name="$1"
  shift
  local rc=0
  STRATA_GPU_CARRY="$carry" STRATA_GPU_SCRATCH="$tmp/scratch-$name" \
    "$check" run "$@" --out "$tmp/out-$name" >"$tmp/$name.log" 2>&1 || rc=$?
  # The stubs fail the benchmarks and find no GPU: the check must fail, and say so.
  [ "$rc" = 1 ] || { cat "$tmp/$name.log" >&2; fail "run $* exited $rc (expected 1)"; }
  grep -q '^# GPU check: FAILED' "$tmp/out-$name/summary.md" || fail "run $*: no summary.md"
  tar -xzOf "$tmp/out-$name/details.tar.gz" steps.tsv | cut -f1
}

steps="$(stubbed_run check)"
no_micro "$steps" "run"
check_order "$steps"
grep -q 'STRATA_ATTENTION=kernels .*strata_gpu_bench attention' "$tmp/check.log" ||
  fail "the kernels' attention steps do not run with STRATA_ATTENTION=kernels"
grep -q "may take up to --budget" "$tmp/check.log" || fail "run does not say what run --train may take"

steps="$(stubbed_run micro --micro --quick)"
check_order "$steps"
micro_after_attention "$steps"

steps="$(stubbed_run train --train --quick)"
train_order "$steps"
grep -E '^== train_nvme .*--steps 2 --warmup 1 .*--deadline [0-9]+' "$tmp/train.log" >/dev/null ||
  fail "train_nvme does not run 2 steps with a --deadline"
[ "$(index_of train_largest "$steps")" = 0 ] || fail "train_largest ran without --largest: $(flat "$steps")"
steps="$(stubbed_run largest --train --quick --largest)"
train_order "$steps"
before train_nvme train_largest "$steps"
grep -E '^== train_hbm .*--cpu-adam-gps' "$tmp/train.log" >/dev/null &&
  fail "train_hbm takes --cpu-adam-gps, measured after it"

echo "gpu_check_steps_test: run, run --micro and run --train list and take their steps in order"
