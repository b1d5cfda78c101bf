#!/usr/bin/env bash
# The GPU check's script on this machine (ctest gpu_check_prepare_and_run, labels deploy and slow):
#   1. `deploy/gpu-check.sh prepare` builds build/gpu-check and lays out the carry folder, which
#      must hold a manifest, the CLI, the GPU benchmarks and at least one test executable with GPU
#      tests, within the size a device call carries;
#   2. `deploy/gpu-check.sh run --quick --micro` runs every step here. Without a GPU every GPU
#      test skips, and the check must then FAIL, counting each skip (a broken CUDA set-up must
#      never pass); with a GPU it must pass.
# First, the steps' order with stub binaries (tests/deploy/gpu_check_steps_test.sh).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
out="${1:?usage: gpu_check_test.sh OUT_DIR}"
fail() {
  echo "gpu_check_test: $*" >&2
  exit 1
}

"$root/tests/deploy/gpu_check_steps_test.sh"

"$root/deploy/gpu-check.sh" prepare
carry="${STRATA_GPU_CARRY:-$root/build/gpu-carry}"
[ -f "$carry/manifest.json" ] || fail "prepare wrote no manifest"
python3 - "$carry/manifest.json" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
assert m["gpu_test_executables"], "no test executable with GPU tests"
for b in ("strata", "strata_gpu_bench", "strata_overlap_bench"):
    assert b in m["binaries"], f"{b} not carried"
for lib in ("libcublas.so.13", "libnccl.so.2"):
    assert lib in m["runtime_libs"], f"{lib} not among the libraries the GPU machine must provide"
print("manifest:", m["gpu_test_executables"], "glibc", m["glibc_needed"])
PY
# DeepSpeed travels as wheels for the GPU machine's CPython 3.12: every requirement of every wheel
# is another wheel of the set or a package that machine's image has (the device library's
# KINDS.md lists them), so that pip installs it there with no index.
python3 - "$carry" <<'PY'
import glob, json, os, re, sys, zipfile
carry = sys.argv[1]
m = json.load(open(os.path.join(carry, "manifest.json")))
assert m.get("deepspeed") == "0.19.8", f"DeepSpeed not carried: {m.get('deepspeed')}"
image = set("einops msgpack ninja numpy packaging psutil py-cpuinfo torch tqdm "
            "typing-extensions".split())
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
names, reqs = set(), {}
for w in glob.glob(os.path.join(carry, "wheels", "*.whl")):
    z = zipfile.ZipFile(w)
    text = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    name = norm(re.search(r"^Name: (.+)$", text, re.M).group(1))
    names.add(name)
    reqs[name] = [norm(re.match(r"[A-Za-z0-9_.\-]+", l[15:]).group(0)) for l in text.splitlines()
                  if l.startswith("Requires-Dist: ") and "extra ==" not in l]
assert "deepspeed" in names, names
missing = {n: [r for r in rs if r not in names and r not in image] for n, rs in reqs.items()}
assert not any(missing.values()), f"requirements neither carried nor on the GPU image: {missing}"
for f in ("libaio.so.1", "libaio.so", "libaio.h"):
    assert os.path.isfile(os.path.join(carry, "libaio", f)), f"libaio/{f} not carried"
print("DeepSpeed carried:", sorted(names))
PY
size_mib=$(( $(du -sk "$carry" | cut -f1) / 1024 ))
[ "$size_mib" -le 56 ] || fail "the carry folder is $size_mib MiB (at most 56)"

rm -rf "$out"
set +e
"$root/deploy/gpu-check.sh" run --quick --micro --budget 400 --out "$out" >"$out.log" 2>&1
rc=$?
set -e
cat "$out.log"
for f in summary.md summary.json run.log details.tar.gz; do
  [ -s "$out/$f" ] || fail "run left no $f in $out"
done
if nvidia-smi -L >/dev/null 2>&1; then
  [ "$rc" = 0 ] || fail "with a GPU the check must pass (exit $rc)"
  exit 0
fi
[ "$rc" = 1 ] || fail "without a GPU the check must fail with exit 1 (got $rc)"
python3 - "$out/summary.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
assert s["passed"] is False
t = s["test_totals"]
assert t["tests"] > 0 and t["skipped"] == t["tests"] and t["passed"] == 0, t
assert any("SKIPPED" in p and "a skip fails the check" in p for p in s["problems"]), s["problems"][:5]
assert any(p.startswith("no GPU:") for p in s["problems"]), s["problems"][:5]
print(f"without a GPU: {t['skipped']} GPU tests skipped, each counted as a failure")
PY
grep -q '^# GPU check: FAILED' "$out/summary.md" || fail "summary.md does not say FAILED"
