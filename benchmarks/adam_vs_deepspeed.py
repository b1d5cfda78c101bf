#!/usr/bin/env python3
"""adam_vs_deepspeed.py: Strata's CPU AdamW against DeepSpeed's CPU Adam, measured in one run.

Run it with the python of deploy/hf-venv.sh (DeepSpeed 0.19.8 from PyPI over PyPI's torch 2.15):

  build/default/hf-venv/bin/python benchmarks/adam_vs_deepspeed.py \\
      --adam-bench build/default/benchmarks/strata_adam_bench [--elements 134217728] [--threads 1 2]

For each thread count, rounds alternate between the two (--rounds, default 3), so that both see
the same machine state:
  strata     `strata_adam_bench --elements N --threads T --json`: the median s/step of its
             "strata" variant (CpuAdamStep, AdamW, fp32 states, no 16-bit copy) over its --reps;
  deepspeed  DeepSpeedCPUAdam (adamw_mode, fp32 parameters and states), built by DeepSpeed's
             own op builder (CPUAdamBuilder's JIT build, with its -march=native, OpenMP and AVX
             width flags), on one fp32 tensor of N elements with a gradient, OMP_NUM_THREADS=T:
             the median s/step over --reps steps after 2 warm-up steps, in a process of its own.
             --deepspeed-build o3 (the default) adds -O3: DeepSpeed 0.12's builder passes its
             -O3 only when torch has CUDA, so with a CPU-only torch (Debian's) its users get an
             unoptimised op; --deepspeed-build builder measures exactly that. Each build has its
             own TORCH_EXTENSIONS_DIR under ~/.cache/strata-deepspeed/.
The ratio is DeepSpeed's s/step / Strata's (the medians of the rounds). Target: >= 1.3 at 1 and 2
threads (--target).

Output: a table, then one JSON object (also to --json FILE). Exit 0 when both ran (targets met
or not), 1 when a side failed, 2 for bad options.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from deepspeed_peer import DEEPSPEED_VERSION, emit, has_deepspeed, worker_prelude

DS_WORKER = r'''
import json, os, statistics, sys, time
import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam
n, reps, threads = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(threads)
torch.manual_seed(0)
p = torch.nn.Parameter(torch.randn(n, dtype=torch.float32) * 0.02)
p.grad = torch.randn(n, dtype=torch.float32) * 1e-3
opt = DeepSpeedCPUAdam([p], lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                       adamw_mode=True, fp32_optimizer_states=True)
for _ in range(2):
    opt.step()
times = []
for _ in range(reps):
    t0 = time.perf_counter()
    opt.step()
    times.append(time.perf_counter() - t0)
print(json.dumps({"seconds_per_step": statistics.median(times), "min_seconds": min(times),
                  "reps": reps, "threads": threads, "elements": n,
                  "finite": bool(torch.isfinite(p).all())}))
'''


def log(msg):
    print("adam_vs_deepspeed: " + msg, file=sys.stderr, flush=True)


def run_strata(args, threads):
    cmd = [args.adam_bench, "--elements", str(args.elements), "--threads", str(threads),
           "--reps", str(args.reps), "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr[-800:]}")
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    run = doc["runs"][0]
    strata = next(v for v in run["variants"] if v["variant"] == "strata")
    return strata["seconds_per_step"], doc.get("isa")


def ds_worker(args):
    return worker_prelude("CPUAdamBuilder", args.deepspeed_build == "o3") + DS_WORKER


def ds_env(args, threads):
    return dict(os.environ, OMP_NUM_THREADS=str(threads),
                TORCH_EXTENSIONS_DIR=os.path.expanduser(
                    f"~/.cache/strata-deepspeed/{args.deepspeed_build}"))


def run_deepspeed(args, threads):
    env = ds_env(args, threads)
    cmd = [sys.executable, "-c", ds_worker(args), str(args.elements), str(args.reps),
           str(threads)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"DeepSpeedCPUAdam exited {r.returncode}: {r.stderr[-1500:]}")
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    if not doc["finite"]:
        raise RuntimeError("DeepSpeedCPUAdam produced non-finite parameters")
    return doc["seconds_per_step"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--adam-bench", required=True, help="the strata_adam_bench binary")
    ap.add_argument("--elements", type=int, default=1 << 27)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=7, help="timed steps per round and side")
    ap.add_argument("--target", type=float, default=1.3)
    ap.add_argument("--deepspeed-build", choices=["o3", "builder"], default="o3",
                    help="o3: DeepSpeed's op builder flags plus -O3 (default); builder: its flags "
                         "alone (no -O3 with a CPU-only torch)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.elements < 1024 or args.rounds < 1 or args.reps < 1:
        ap.error("--elements >= 1024, --rounds >= 1 and --reps >= 1")
    if not os.access(args.adam_bench, os.X_OK):
        ap.error(f"--adam-bench {args.adam_bench}: not an executable")
    if not has_deepspeed("adam_vs_deepspeed"):
        return 2

    # DeepSpeed builds its op once (cached under ~/.cache/torch_extensions): not timed.
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", ds_worker(args), "1024", "1", "1"],
                       capture_output=True, text=True, timeout=1800, env=ds_env(args, 1))
    if r.returncode != 0:
        log(f"building DeepSpeed's CPU Adam failed:\n{r.stderr[-3000:]}")
        return 1
    log(f"DeepSpeed's CPU Adam op ready ({time.monotonic() - t0:.0f} s, built or loaded from the "
        "cache)")

    rows, failed, isa = [], False, None
    for threads in args.threads:
        strata_s, ds_s = [], []
        try:
            for rnd in range(args.rounds):
                s, isa = run_strata(args, threads)
                d = run_deepspeed(args, threads)
                strata_s.append(s)
                ds_s.append(d)
                log(f"{threads} thread(s), round {rnd + 1}: strata {s:.4f} s/step, "
                    f"deepspeed {d:.4f} s/step ({d / s:.2f}x)")
        except RuntimeError as e:
            log(str(e))
            rows.append({"threads": threads, "error": str(e)})
            failed = True
            continue
        s, d = statistics.median(strata_s), statistics.median(ds_s)
        rows.append({"threads": threads, "strata_seconds_per_step": s,
                     "deepspeed_seconds_per_step": d, "ratio": d / s, "target": args.target,
                     "met": d / s >= args.target, "strata_rounds": strata_s,
                     "deepspeed_rounds": ds_s})

    print(f"CPU AdamW, {args.elements} fp32 parameters ({args.elements * 16 / 2**30:.1f} GiB of "
          f"parameters, gradients and states), Strata ISA {isa}, DeepSpeed {DEEPSPEED_VERSION} CPU Adam "
          f"({'op builder flags + -O3' if args.deepspeed_build == 'o3' else 'op builder flags only'})")
    print(f"{'threads':>7} {'strata s/step':>14} {'deepspeed s/step':>17} {'ratio':>7} {'target':>8}")
    for row in rows:
        if "error" in row:
            print(f"{row['threads']:>7} error: {row['error'][:100]}")
            continue
        print(f"{row['threads']:>7} {row['strata_seconds_per_step']:>14.4f} "
              f"{row['deepspeed_seconds_per_step']:>17.4f} {row['ratio']:>7.2f} "
              f">= {args.target:<4g}{' met' if row['met'] else ' NOT met'}")
    out = {"benchmark": "adam_vs_deepspeed", "elements": args.elements, "rounds": args.rounds,
           "reps": args.reps, "strata_isa": isa, "deepspeed": DEEPSPEED_VERSION,
           "deepspeed_build": args.deepspeed_build, "results": rows}
    emit(out, args.json)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
