#!/usr/bin/env python3
"""Compare `strata nvme-bench` with fio on the same file, in alternating runs.

For each setting (read and write; block 1 MiB; queue depth 8, 32 and 128; one thread) every
round runs, in a rotating order:
  strata       strata nvme-bench --path FILE --rw read|write --block 1M --qd D --threads 1
  fio-default  fio --ioengine=io_uring --direct=1 (fio's default buffers)
  fio-huge     fio --ioengine=io_uring --direct=1 --mem=shmhuge --iodepth_batch_submit=D
               --iodepth_batch_complete_min=1 (huge-page buffers, batched submission)
  fio-libaio   fio --ioengine=libaio --direct=1 (the kernel AIO interface DeepSpeed uses)
and prints the median GB/s (10^9 bytes/s) of each and the ratio strata / best fio form, where the
best fio form is the better of fio-default and fio-huge (the io_uring forms). The target is a
median ratio >= 0.97 at every setting.

Huge pages for fio's shmhuge buffers are reserved (vm.nr_hugepages) for the run and the previous
setting is restored afterwards, also on error or Ctrl-C. Needs root for that; without it the
fio-huge form is skipped and said so.

Output: progress on stderr, the table of medians on stdout and, with --json FILE, the raw runs
and medians as JSON.
Usage: benchmarks/nvme_vs_fio.py --strata build/default/strata --dir /mnt/nvme0 [--size 2G]
       [--rounds 5] [--depths 8,32,128] [--json out.json]
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

NR_HUGEPAGES = "/proc/sys/vm/nr_hugepages"


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def run(cmd):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        raise RuntimeError("command failed (%d): %s\n%s" % (p.returncode, " ".join(cmd), p.stderr))
    return p.stdout


def strata_gbps(strata, path, size, op, depth):
    out = run([strata, "nvme-bench", "--path", path, "--size", str(size), "--rw", op,
               "--block", "1M", "--qd", str(depth), "--threads", "1", "--json"])
    result = json.loads(out)["results"][0]
    phase = [p for p in result["phases"] if p["op"] == op][0]
    return phase["gb_per_s"], {"backend": result["backend"], "direct": result["direct"],
                               "buffers": result["buffers"]}


def fio_gbps(path, size, op, depth, form):
    cmd = ["fio", "--name=cmp", "--filename=" + path, "--size=%d" % size, "--rw=" + op,
           "--bs=1M", "--iodepth=%d" % depth, "--numjobs=1", "--direct=1",
           "--output-format=json", "--invalidate=1"]
    if form == "fio-default":
        cmd += ["--ioengine=io_uring"]
    elif form == "fio-huge":
        cmd += ["--ioengine=io_uring", "--mem=shmhuge", "--iodepth_batch_submit=%d" % depth,
                "--iodepth_batch_complete_min=1"]
    elif form == "fio-libaio":
        cmd += ["--ioengine=libaio"]
    else:
        raise ValueError(form)
    job = json.loads(run(cmd))["jobs"][0]
    return job[op]["bw_bytes"] / 1e9, {}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--strata", default="build/default/strata", help="the strata binary")
    ap.add_argument("--dir", required=True, help="directory on the drive to measure")
    ap.add_argument("--size", default="2G", help="file size: 1G..4G (default 2G)")
    ap.add_argument("--rounds", type=int, default=9, help="alternating rounds (default 9)")
    ap.add_argument("--depths", default="8,32,128", help="queue depths (default 8,32,128)")
    ap.add_argument("--ops", default="read,write", help="read,write (default both)")
    ap.add_argument("--json", help="write raw runs and medians here")
    ap.add_argument("--settle", type=float, default=5.0,
                    help="seconds to wait (after a sync) before each op's rounds (default 5)")
    ap.add_argument("--pause", type=float, default=1.0,
                    help="seconds to wait (after a sync) before each run (default 1)")
    args = ap.parse_args()

    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    size = int(args.size[:-1]) * units[args.size[-1].upper()] if args.size[-1].isalpha() \
        else int(args.size)
    depths = [int(d) for d in args.depths.split(",")]
    ops = args.ops.split(",")
    if shutil.which("fio") is None:
        sys.exit("fio is not installed (deploy/install-deps.sh installs it)")
    if not os.access(args.strata, os.X_OK):
        sys.exit("no strata binary at %s (build first, or pass --strata)" % args.strata)

    path = os.path.join(args.dir, "strata-vs-fio.dat")
    forms = ["strata", "fio-default", "fio-huge", "fio-libaio"]

    # Reserve huge pages for fio's shmhuge buffers (depth x 1 MiB, plus slack), restore later.
    # `saved` is set only when this script changed the setting, so only then is it restored.
    saved = None
    try:
        with open(NR_HUGEPAGES) as f:
            before = int(f.read())
        want = max(depths) // 2 + 16
        if before < want:
            with open(NR_HUGEPAGES, "w") as f:
                f.write(str(want))
            saved = before
        with open(NR_HUGEPAGES) as f:
            got = int(f.read())
        if got < max(depths) // 2 + 1:
            log("could only reserve %d huge pages; skipping the fio-huge form" % got)
            forms.remove("fio-huge")
    except OSError as e:
        log("cannot reserve huge pages (%s); skipping the fio-huge form" % e)
        if "fio-huge" in forms:
            forms.remove("fio-huge")

    runs = {}  # (op, depth, form) -> [GB/s]
    info = {}
    try:
        log("laying out %s (%d bytes)" % (path, size))
        run(["fio", "--name=layout", "--filename=" + path, "--size=%d" % size, "--rw=write",
             "--bs=1M", "--iodepth=32", "--ioengine=io_uring", "--direct=1",
             "--output-format=json"])
        # Reads first, then writes: a read measured right after gigabytes of writes would mostly
        # measure the device (or the host, on a VM) flushing them. Within each op, the forms
        # alternate round by round.
        for op in ops:
            subprocess.run(["sync"])
            time.sleep(args.settle)
            for rnd in range(args.rounds):
                for depth in depths:
                    # Rotate the order so that no form always runs first.
                    order = forms[rnd % len(forms):] + forms[:rnd % len(forms)]
                    for form in order:
                        # Each run starts from the same state: earlier writes flushed (on a VM
                        # this reaches the host's cache too), then a short pause.
                        subprocess.run(["sync"])
                        time.sleep(args.pause)
                        if form == "strata":
                            gbps, meta = strata_gbps(args.strata, path, size, op, depth)
                            info.update(meta)
                        else:
                            gbps, _ = fio_gbps(path, size, op, depth, form)
                        runs.setdefault((op, depth, form), []).append(gbps)
                    log("round %d/%d %-5s qd %-3d %s" % (
                        rnd + 1, args.rounds, op, depth,
                        "  ".join("%s %.2f" % (f, runs[(op, depth, f)][-1]) for f in forms)))
    finally:
        if os.path.exists(path):
            os.unlink(path)
        if saved is not None:
            try:
                with open(NR_HUGEPAGES, "w") as f:
                    f.write(str(saved))
            except OSError as e:
                log("could not restore vm.nr_hugepages to %d: %s" % (saved, e))

    rows = []
    for op in ops:
        for depth in depths:
            med = {f: statistics.median(runs[(op, depth, f)]) for f in forms}
            best_form = max((f for f in forms if f in ("fio-default", "fio-huge")),
                            key=lambda f: med[f])
            rows.append({"op": op, "block": "1M", "queue_depth": depth, "threads": 1,
                         "median_gb_per_s": med, "best_fio": best_form,
                         "ratio_vs_best_fio": med["strata"] / med[best_form],
                         "ratio_vs_libaio": med["strata"] / med["fio-libaio"]})

    header = "%-5s %4s " % ("op", "qd") + " ".join("%11s" % f for f in forms) + \
        "  strata/best-fio  strata/libaio"
    print(header)
    for r in rows:
        print("%-5s %4d " % (r["op"], r["queue_depth"]) +
              " ".join("%11.2f" % r["median_gb_per_s"][f] for f in forms) +
              "  %15.3f  %13.3f" % (r["ratio_vs_best_fio"], r["ratio_vs_libaio"]))
    print("medians of %d alternating rounds, GB/s = 10^9 bytes/s, block 1 MiB, 1 thread, "
          "file %d bytes; strata: %s" % (args.rounds, size, json.dumps(info)))
    ok = all(r["ratio_vs_best_fio"] >= 0.97 for r in rows)
    print("target (ratio >= 0.97 at every setting): %s" % ("met" if ok else "NOT met"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size": size, "rounds": args.rounds, "strata": info, "rows": rows,
                       "runs": [{"op": k[0], "queue_depth": k[1], "form": k[2], "gb_per_s": v}
                                for k, v in runs.items()],
                       "time": time.strftime("%Y-%m-%dT%H:%M:%S")}, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
