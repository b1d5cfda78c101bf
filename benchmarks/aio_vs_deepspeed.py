#!/usr/bin/env python3
"""aio_vs_deepspeed.py: `strata nvme-bench` against DeepSpeed's async I/O handle, in one run.

Run it with the python of deploy/hf-venv.sh (DeepSpeed 0.19.8 over PyPI's torch 2.15; its async_io
op is built by DeepSpeed's own op builder against libaio, with -O3 added as for the CPU Adam
comparison, and cached under ~/.cache/strata-deepspeed/aio):

  build/default/hf-venv/bin/python benchmarks/aio_vs_deepspeed.py --strata build/default/strata \\
      --dir /mnt/nvme0 [--size 1GiB] [--qd 8 32 128] [--rounds 3]

Both sides move the same file of --size bytes in 1 MiB requests with O_DIRECT, one I/O thread,
at each queue depth, write then read (sequential):
  strata     `strata nvme-bench --path DIR --size S --block 1M --qd Q --rw both --json`
             (io_uring, registered buffers, one ring);
  deepspeed  `aio_handle(block_size=1 MiB, queue_depth=Q, single_submit=False,
             overlap_events=True, num_threads=1)`: `sync_pwrite` then `sync_pread` of the whole
             file from a page-locked tensor (`new_cpu_locked_tensor`), timed around each call.
Rounds alternate the two sides; the table shows the medians' GB/s and Strata / DeepSpeed.
Target (issue 21): >= 1.15 at every queue depth, read and write.

Output: a table and one JSON object (also --json FILE). Exit 0 when both ran, 1 when a side
failed, 2 for bad options.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

from deepspeed_peer import DEEPSPEED_VERSION, emit, has_deepspeed, worker_prelude

DS_WORKER = worker_prelude("AsyncIOBuilder", add_o3=True) + r'''
import json, os, sys, time
import torch
aio = AsyncIOBuilder().load(verbose=False)
path, size, qd = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
h = aio.aio_handle(1 << 20, qd, False, True, 1)
buf = h.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))
buf.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
out = {}
t0 = time.perf_counter()
rc = h.sync_pwrite(buf, path)
out["write_s"] = time.perf_counter() - t0
t0 = time.perf_counter()
rc2 = h.sync_pread(buf, path)
out["read_s"] = time.perf_counter() - t0
out["rc"] = [rc, rc2]
h.free_cpu_locked_tensor(buf)
os.remove(path)
print(json.dumps(out))
'''


def log(msg):
    print("aio_vs_deepspeed: " + msg, file=sys.stderr, flush=True)


def parse_size(text):
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.lower().rstrip("ib").rstrip("b")
    return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)


def run_strata(args, qd):
    cmd = [args.strata, "nvme-bench", "--path", args.dir, "--size", str(args.size), "--block",
           "1M", "--qd", str(qd), "--threads", "1", "--rw", "both", "--direct", "on", "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr[-800:]}")
    phases = json.loads(r.stdout)["results"][0]["phases"]
    return {p["op"]: p["gb_per_s"] for p in phases}


def run_deepspeed(args, qd):
    path = os.path.join(args.dir, f"ds-aio-{os.getpid()}.bin")
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=os.path.expanduser("~/.cache/strata-deepspeed/aio"))
    r = subprocess.run([sys.executable, "-c", DS_WORKER, path, str(args.size), str(qd)],
                       capture_output=True, text=True, timeout=1800, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"DeepSpeed aio exited {r.returncode}: {r.stderr[-1500:]}")
    d = json.loads(r.stdout.strip().splitlines()[-1])
    if any(rc < 0 for rc in d["rc"]):
        raise RuntimeError(f"DeepSpeed aio returned {d['rc']}")
    return {"write": args.size / d["write_s"] / 1e9, "read": args.size / d["read_s"] / 1e9}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--strata", required=True)
    ap.add_argument("--dir", required=True, help="a directory on the drive to measure")
    ap.add_argument("--size", type=parse_size, default=1 << 30)
    ap.add_argument("--qd", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--target", type=float, default=1.15)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.size < (1 << 20) or args.size % (1 << 20) or args.rounds < 1:
        ap.error("--size: a multiple of 1 MiB; --rounds >= 1")
    if not os.path.isdir(args.dir):
        ap.error(f"--dir {args.dir}: not a directory")
    if not has_deepspeed("aio_vs_deepspeed"):
        return 2

    rows, failed = [], False
    for qd in args.qd:
        got = {"strata": {"write": [], "read": []}, "deepspeed": {"write": [], "read": []}}
        try:
            for rnd in range(args.rounds):
                for side, fn in (("strata", run_strata), ("deepspeed", run_deepspeed)):
                    r = fn(args, qd)
                    for op in ("write", "read"):
                        got[side][op].append(r[op])
                log(f"qd {qd}, round {rnd + 1}: strata w {got['strata']['write'][-1]:.2f} "
                    f"r {got['strata']['read'][-1]:.2f} GB/s, deepspeed w "
                    f"{got['deepspeed']['write'][-1]:.2f} r {got['deepspeed']['read'][-1]:.2f} GB/s")
        except RuntimeError as e:
            log(str(e))
            rows.append({"qd": qd, "error": str(e)})
            failed = True
            continue
        for op in ("write", "read"):
            s = statistics.median(got["strata"][op])
            d = statistics.median(got["deepspeed"][op])
            rows.append({"qd": qd, "op": op, "strata_gb_per_s": s, "deepspeed_gb_per_s": d,
                         "ratio": s / d, "target": args.target, "met": s / d >= args.target,
                         "strata_rounds": got["strata"][op],
                         "deepspeed_rounds": got["deepspeed"][op]})

    print(f"1 MiB requests, O_DIRECT, one I/O thread, {args.size / 2**30:.2f} GiB in {args.dir}; "
          f"DeepSpeed {DEEPSPEED_VERSION} aio_handle")
    print(f"{'qd':>4} {'op':>6} {'strata GB/s':>12} {'deepspeed GB/s':>15} {'ratio':>7} {'target':>8}")
    for row in rows:
        if "error" in row:
            print(f"{row['qd']:>4} error: {row['error'][:100]}")
            continue
        print(f"{row['qd']:>4} {row['op']:>6} {row['strata_gb_per_s']:>12.2f} "
              f"{row['deepspeed_gb_per_s']:>15.2f} {row['ratio']:>7.2f} >= {args.target:<4g}"
              f"{' met' if row['met'] else ' NOT met'}")
    out = {"benchmark": "aio_vs_deepspeed", "size": args.size, "dir": args.dir,
           "rounds": args.rounds, "deepspeed": DEEPSPEED_VERSION, "results": rows}
    emit(out, args.json)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
