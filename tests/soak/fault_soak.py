#!/usr/bin/env python3
"""Fault soak: `strata train` with NVMe offload under STRATA_FAULT_INJECT, run after run, until a
target number of I/O faults has been injected. Every run must end one of two ways:

  retried   exit 0 and a final checkpoint byte-identical to the fault-free run's (every fault
            was absorbed: EAGAIN and short transfers are resubmitted by the I/O backend);
  surfaced  a non-zero exit with an error line (EIO, ENOSPC, a checksum mismatch, ...).

A run that exits 0 with a different checkpoint is a *silent difference*: the soak fails if there
is any. Prints a table and (--json) one JSON object; docs/testing.md records a full run.

  tests/soak/fault_soak.py --strata build/default/strata --faults 10000
"""
import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

# Three kinds of runs take turns: only faults the backend retries, a mix that also has faults that
# must surface (request-level EIO / ENOSPC, corrupted reads), and corrupted reads.
RETRIED = "eagain={p},short={p},seed={seed}"
MIXED = "eagain={p},short={p},eio={e},enospc={e},corrupt={e},seed={seed}"
# And runs whose reads come back corrupted now and then: each must stop with a checksum mismatch.
CORRUPT = "eagain={p},corrupt={c},seed={seed}"


def config(nvme):
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.005}},
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": 4096,
            "stage3_param_persistence_threshold": 0,
            "offload_param": {"device": "nvme", "nvme_path": nvme},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme},
        },
        # Every use of a parameter shard reads NVMe: many transfers per step.
        "strata": {"memory": {"host_budget": "64KiB"}},
    }


def digest(step_dir):
    h = hashlib.sha256()
    for name in sorted(os.listdir(step_dir)):
        if name.endswith(".safetensors"):
            with open(os.path.join(step_dir, name), "rb") as f:
                h.update(name.encode())
                h.update(f.read())
    return h.hexdigest()


def train(strata, work, name, steps, data, env_extra, timeout):
    run = os.path.join(work, name)
    nvme = os.path.join(run, "nvme")
    os.makedirs(nvme)
    cfg = os.path.join(run, "ds.json")
    with open(cfg, "w") as f:
        json.dump(config(nvme), f)
    env = dict(os.environ, **env_extra)
    cmd = [strata, "train", "--config", cfg, "--model", "llama-tiny", "--data", data,
           "--seq-len", "16", "--steps", str(steps), "--save", os.path.join(run, "ck"),
           "--sampling", "sequential"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    m = re.search(r"STRATA_FAULT_INJECT: injected .*\((\d+) in all\)", p.stderr)
    faults = int(m.group(1)) if m else 0
    kinds = {}
    if m:
        for k, v in re.findall(r"(eio|enospc|eagain|short|corrupt) (\d+)", m.group(0)):
            kinds[k] = int(v)
    ck = os.path.join(run, "ck", "latest")
    result = {"name": name, "exit": p.returncode, "faults": faults, "kinds": kinds,
              "digest": digest(ck) if p.returncode == 0 and os.path.exists(ck) else None,
              "error": next((l for l in p.stderr.splitlines() if "error:" in l), "")}
    shutil.rmtree(run, ignore_errors=True)
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strata", required=True)
    ap.add_argument("--faults", type=int, default=10000, help="stop once this many were injected")
    ap.add_argument("--max-runs", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--retry-p", type=float, default=0.3,
                    help="probability of EAGAIN and of a short transfer per backend transfer")
    ap.add_argument("--error-p", type=float, default=0.002,
                    help="probability of EIO, ENOSPC (writes) and a corrupted read per request")
    ap.add_argument("--corrupt-p", type=float, default=0.01,
                    help="probability of a corrupted read per request in the corrupt runs")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    work = tempfile.mkdtemp(prefix="strata-soak-")
    t0 = time.time()
    try:
        data = os.path.join(work, "tokens.bin")
        subprocess.run([args.strata, "data", "synth", "--out", data, "--tokens", "20k",
                        "--vocab", "256"], check=True, capture_output=True)
        base = train(args.strata, work, "baseline", args.steps, data, {}, args.timeout)
        if base["exit"] != 0 or base["digest"] is None:
            print(f"fault_soak: the fault-free run failed: {base['error']}", file=sys.stderr)
            return 2
        runs = []
        total = 0
        for i in range(args.max_runs):
            spec = (RETRIED, MIXED, CORRUPT)[i % 3].format(p=args.retry_p, e=args.error_p,
                                                           c=args.corrupt_p, seed=i + 1)
            r = train(args.strata, work, f"run{i}", args.steps, data,
                      {"STRATA_FAULT_INJECT": spec}, args.timeout)
            r["spec"] = spec
            if r["exit"] == 0:
                r["outcome"] = "retried" if r["digest"] == base["digest"] else "silent"
            else:
                r["outcome"] = "surfaced" if r["error"] else "died"
            runs.append(r)
            total += r["faults"]
            if total >= args.faults:
                break
    finally:
        shutil.rmtree(work, ignore_errors=True)

    count = {k: sum(1 for r in runs if r["outcome"] == k)
             for k in ("retried", "surfaced", "silent", "died")}
    kinds = {}
    for r in runs:
        for k, v in r["kinds"].items():
            kinds[k] = kinds.get(k, 0) + v
    errors = {}
    for r in runs:
        if r["outcome"] == "surfaced":
            e = r["error"]
            key = ("checksum mismatch" if "checksum mismatch" in e else
                   "ENOSPC" if "ENOSPC" in e else "EIO" if "EIO" in e else "other")
            errors[key] = errors.get(key, 0) + 1
    out = {"benchmark": "fault_soak", "runs": len(runs), "faults": total, "faults_by_kind": kinds,
           "outcomes": count, "surfaced_errors": errors, "silent_differences": count["silent"],
           "seconds": round(time.time() - t0, 1), "steps_per_run": args.steps}
    print(f"fault soak: {len(runs)} runs of {args.steps} steps, {total} faults injected "
          f"in {out['seconds']} s")
    print(f"  {'kind':<10} {'faults':>8}")
    for k in ("eagain", "short", "eio", "enospc", "corrupt"):
        print(f"  {k:<10} {kinds.get(k, 0):>8}")
    print(f"  {'outcome':<10} {'runs':>8}")
    for k, v in count.items():
        print(f"  {k:<10} {v:>8}")
    print(f"  surfaced as: {', '.join(f'{k} {v}' for k, v in sorted(errors.items())) or 'none'}")
    print(f"silent differences: {count['silent']} (must be 0); died without an error: "
          f"{count['died']} (must be 0)")
    if args.json:
        print(json.dumps(out))
    bad = [r for r in runs if r["outcome"] in ("silent", "died")]
    for r in bad[:5]:
        print(f"  {r['outcome']}: {r['spec']} exit {r['exit']} {r['error']}", file=sys.stderr)
    if total < args.faults and len(runs) >= args.max_runs:
        print(f"fault_soak: only {total} faults in {args.max_runs} runs", file=sys.stderr)
        return 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
