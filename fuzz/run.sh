#!/usr/bin/env bash
# Builds the libFuzzer targets (cmake --preset fuzz: clang, ASan+UBSan) and runs each for a fixed
# number of executions from its seed corpus in fuzz/corpus/<target>/. A crash stops the script
# with the target's output; libFuzzer writes the input as crash-<hash> in the current directory:
# fix the bug, then add the input to fuzz/regressions/<target>/ (replayed by ctest, fuzz_regressions).
#
#   fuzz/run.sh                  # every target, 10^6 executions each
#   fuzz/run.sh -n 100000 npy    # one target, fewer executions
set -euo pipefail
cd "$(dirname "$0")/.."
runs=1000000
while getopts "n:" opt; do
  case $opt in
    n) runs=$OPTARG ;;
    *) echo "usage: fuzz/run.sh [-n RUNS] [TARGET...]" >&2; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(config_fuzz byte_size_fuzz hf_config_fuzz safetensors_fuzz npy_fuzz)

cmake --preset fuzz >/dev/null
cmake --build --preset fuzz --target "${targets[@]}"
export ASAN_OPTIONS=abort_on_error=1:detect_leaks=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
printf '%-18s %12s %10s %8s\n' target executions seconds corpus
for t in "${targets[@]}"; do
  name=${t%_fuzz}
  # A scratch copy of the seeds: what the run adds to the corpus stays out of the repository.
  mkdir -p "$work/$name"
  cp fuzz/corpus/"$name"/* "$work/$name"/ 2>/dev/null || true
  start=$(date +%s)
  if ! build/fuzz/fuzz/"$t" -runs="$runs" -max_len=65536 -timeout=10 -rss_limit_mb=4096 \
        -print_final_stats=1 "$work/$name" > "$work/$t.log" 2>&1; then
    tail -60 "$work/$t.log" >&2
    echo "fuzz/run.sh: $t found a crash (see above; the input is in crash-* here)" >&2
    exit 1
  fi
  secs=$(( $(date +%s) - start ))
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$work/$t.log" | grep -o '[0-9]*$' || echo "?")
  printf '%-18s %12s %10s %8s\n' "$t" "$execs" "$secs" "$(ls "$work/$name" | wc -l)"
done
echo "fuzz/run.sh: no crashes"
