#!/usr/bin/python3
"""Tokens/s of `strata train` with ZeRO-3 + NVMe offload against the same run in device memory.

The main job's run (deploy/main-job.sh: llama-20m, ZeRO stage 3, bf16, 4 sequences of 64 tokens
per rank, AdamW, WarmupCosineLR, clipping 1.0, 2 MPI ranks on the CPU device) in two DeepSpeed
configs that differ only in the offload:

  nvme    offload_param and offload_optimizer on "nvme" (as the main job)
  device  offload_param and offload_optimizer "none": every state in device memory

Each configuration runs --repeat times, alternating (nvme, device, device, nvme, ...), each run
`mpirun -np N strata train ... --steps S --metrics FILE`. Per run, the first --warmup steps are
dropped and the rest averaged; per configuration the median over the runs is reported. The
target is tokens/s(nvme) / tokens/s(device) >= 0.85, and an NVMe run whose device memory peak is
within the prefetch budget (stage3_prefetch_bucket_size + stage3_max_live_parameters, in bytes of
the compute dtype). On the CPU device the model's activations are host memory outside the device
allocator, so device_peak_bytes holds no activations (see benchmarks/README.md).

Output: progress on stderr; a table and one JSON object on stdout (and in --json FILE). The exit
status is 1 on an error (a run that fails or times out), 2 on bad options, 0 otherwise, whether
or not the target was met. Standard library only; run with /usr/bin/python3.

Usage: benchmarks/train_offload_bench.py [--strata build/default/strata]
       [--nvme-dir /work/benchdir/train-bench] [--steps 30] [--repeat 3] [--json out.json]
"""

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET_RATIO = 0.85
# DeepSpeed's defaults, as Strata resolves them (include/strata/config.h), used when the
# corresponding option is not given (the main job sets neither).
DEFAULT_PREFETCH_BUCKET = 50_000_000
DEFAULT_MAX_LIVE = 1_000_000_000
CONFIGS = ("nvme", "device")
# Above this many CPUs used by other processes during a run, the result is flagged as noisy.
NOISY_FOREIGN_CPUS = 0.25
MIB = 1024.0 * 1024.0


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def die(msg):
    log("train_offload_bench: error: " + msg)
    sys.exit(1)


def loadavg():
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def cpu_busy_seconds():
    """Busy CPU time of the whole machine (all processes), from /proc/stat."""
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:]
    ticks = [int(x) for x in fields]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    busy = sum(ticks[:8]) - idle  # user nice system idle iowait irq softirq steal
    return busy / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def ds_config(kind, swap_dir, args):
    zero = {"stage": 3, "sub_group_size": 1000000}
    if kind == "nvme":
        zero["offload_param"] = {"device": "nvme", "nvme_path": swap_dir}
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": swap_dir}
    else:
        zero["offload_param"] = {"device": "none"}
        zero["offload_optimizer"] = {"device": "none"}
    if args.prefetch_bucket_size is not None:
        zero["stage3_prefetch_bucket_size"] = args.prefetch_bucket_size
    if args.max_live_parameters is not None:
        zero["stage3_max_live_parameters"] = args.max_live_parameters
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW",
                      "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"warmup_num_steps": 20, "total_num_steps": "auto"}},
        "bf16": {"enabled": True},
        "zero_optimization": zero,
    }


def run_checked(cmd, log_path, timeout):
    with open(log_path, "w") as out:
        try:
            p = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
        except FileNotFoundError:
            die("cannot run %s (not found)" % cmd[0])
        except subprocess.TimeoutExpired:
            die("timed out after %d s: %s (output in %s)" % (timeout, " ".join(cmd), log_path))
    if p.returncode != 0:
        with open(log_path) as f:
            tail = "".join(f.readlines()[-15:])
        die("command failed (exit %d): %s\n--- last lines of %s ---\n%s"
            % (p.returncode, " ".join(cmd), log_path, tail))


def mean(xs):
    return sum(xs) / len(xs) if xs else 0.0


def train_once(args, kind, rep, work, swap_dir, tokens):
    cfg_path = os.path.join(work, "ds_%s.json" % kind)
    metrics = os.path.join(work, "metrics-%s-%d.jsonl" % (kind, rep))
    log_path = os.path.join(work, "log-%s-%d.txt" % (kind, rep))
    if kind == "nvme":  # start every NVMe run from an empty swap directory
        shutil.rmtree(swap_dir, ignore_errors=True)
        os.makedirs(swap_dir)
    mpi = ["mpirun", "-np", str(args.np), "--oversubscribe", "--bind-to", "none"]
    if os.geteuid() == 0:
        mpi.append("--allow-run-as-root")
    cmd = mpi + [args.strata, "train", "--config", cfg_path, "--model", args.model,
                 "--data", tokens, "--seq-len", str(args.seq_len), "--steps", str(args.steps),
                 "--metrics", metrics]
    load0 = loadavg()
    busy0, mine0, t0 = cpu_busy_seconds(), children_cpu_seconds(), time.monotonic()
    run_checked(cmd, log_path, args.timeout)
    wall = time.monotonic() - t0
    busy1, mine1 = cpu_busy_seconds(), children_cpu_seconds()
    foreign = max(0.0, (busy1 - busy0) - (mine1 - mine0)) / wall if wall > 0 else 0.0

    with open(metrics) as f:
        steps = [json.loads(line) for line in f if line.strip()]
    if len(steps) != args.steps:
        die("%s: %d steps recorded, expected %d" % (metrics, len(steps), args.steps))
    measured = [s for s in steps if s["step"] > args.warmup]
    params = None
    with open(log_path) as f:
        m = re.search(r"\(([0-9.]+)M parameters", f.read())
        if m:
            params = float(m.group(1)) * 1e6
    tokens_per_step = steps[0]["tokens_per_s"] * steps[0]["step_s"]
    last = steps[-1]
    r = {
        "config": kind,
        "repeat": rep,
        "wall_s": wall,
        "load_average_before": load0,
        "foreign_cpus": foreign,
        "measured_steps": len(measured),
        "tokens_per_step": round(tokens_per_step),
        # Throughput: measured tokens / summed step time (the time-weighted mean). The plain
        # mean of the per-step tokens/s (as `strata train` prints them) weighs a fast step more
        # than a slow one; it is kept for reference.
        "tokens_per_s": tokens_per_step * len(measured) / sum(s["step_s"] for s in measured),
        "tokens_per_s_mean_of_steps": mean([s["tokens_per_s"] for s in measured]),
        "step_s": mean([s["step_s"] for s in measured]),
        "compute_s": mean([s["compute_s"] for s in measured]),
        "exposed_comm_s": mean([s["exposed_comm_s"] for s in measured]),
        "exposed_io_s": mean([s["exposed_io_s"] for s in measured]),
        "exposed_optimizer_s": mean([s["exposed_optimizer_s"] for s in measured]),
        "nvme_read_bytes_per_step": mean([s["nvme_read_bytes"] for s in measured]),
        "nvme_write_bytes_per_step": mean([s["nvme_write_bytes"] for s in measured]),
        # Cumulative over the whole run, warm-up included (as the engine reports them).
        "prefetch_hit_rate": last["prefetch_hit_rate"],
        "device_peak_bytes": max(s["device_peak_bytes"] for s in steps),
        "host_peak_bytes": max(s["host_peak_bytes"] for s in steps),
        "final_loss": last["loss"],
        "parameters": params,
        "metrics_file": metrics,
    }
    log("  %-6s run %d: %.0f tok/s (step %.3f s, exposed io %.3f s), device peak %.1f MiB, "
        "%.0f s wall, other processes %.2f CPUs"
        % (kind, rep + 1, r["tokens_per_s"], r["step_s"], r["exposed_io_s"],
           r["device_peak_bytes"] / MIB, wall, foreign))
    return r


def summarize(runs):
    keys = ["tokens_per_s", "tokens_per_s_mean_of_steps", "step_s", "compute_s", "exposed_comm_s",
            "exposed_io_s", "exposed_optimizer_s", "nvme_read_bytes_per_step",
            "nvme_write_bytes_per_step", "prefetch_hit_rate", "foreign_cpus"]
    out = {k: statistics.median([r[k] for r in runs]) for k in keys}
    out["tokens_per_s_runs"] = [r["tokens_per_s"] for r in runs]
    out["device_peak_bytes"] = max(r["device_peak_bytes"] for r in runs)
    out["host_peak_bytes"] = max(r["host_peak_bytes"] for r in runs)
    return out


def parse_args():
    ap = argparse.ArgumentParser(
        description="strata train tokens/s: ZeRO-3 + NVMe offload vs everything in device memory")
    default_strata = os.path.join(REPO, "build", "default", "strata")
    ap.add_argument("--strata", default=default_strata,
                    help="the strata binary (default: build/default/strata)")
    ap.add_argument("--nvme-dir", default="/work/benchdir/train-bench",
                    help="work directory: token file, configs, metrics, logs, and the NVMe swap "
                         "files under swap/ (default /work/benchdir/train-bench)")
    ap.add_argument("--steps", type=int, default=30, help="steps per run (default 30)")
    ap.add_argument("--warmup", type=int, default=3,
                    help="leading steps left out of the averages (default 3)")
    ap.add_argument("--repeat", type=int, default=3,
                    help="runs per configuration, alternating; medians reported (default 3)")
    ap.add_argument("--np", type=int, default=2, help="MPI ranks (default 2)")
    ap.add_argument("--model", default="llama-20m", help="model preset (default llama-20m)")
    ap.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default 64)")
    ap.add_argument("--micro-batch", type=int, default=4,
                    help="sequences per rank per step (default 4)")
    ap.add_argument("--prefetch-bucket-size", type=int, default=None,
                    help="stage3_prefetch_bucket_size in elements, in both configs (default: "
                         "unset, as in the main job: %d)" % DEFAULT_PREFETCH_BUCKET)
    ap.add_argument("--max-live-parameters", type=int, default=None,
                    help="stage3_max_live_parameters in elements, in both configs (default: "
                         "unset, as in the main job: %d)" % DEFAULT_MAX_LIVE)
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per run (default 1800)")
    ap.add_argument("--keep", action="store_true",
                    help="keep the token file and swap directory (configs, metrics and logs "
                         "are always kept)")
    ap.add_argument("--json", help="also write the JSON object to this file")
    args = ap.parse_args()
    if args.steps < 2 or args.warmup < 0 or args.warmup >= args.steps:
        ap.error("need --steps >= 2 and 0 <= --warmup < --steps")
    if args.repeat < 1 or args.np < 1 or args.seq_len < 1 or args.micro_batch < 1:
        ap.error("--repeat, --np, --seq-len and --micro-batch must be >= 1")
    for name in ("prefetch_bucket_size", "max_live_parameters"):
        v = getattr(args, name)
        if v is not None and v < 0:
            ap.error("--%s must be >= 0" % name.replace("_", "-"))
    args.strata = os.path.abspath(args.strata)
    if not os.access(args.strata, os.X_OK):
        ap.error("%s: not an executable; build first (cmake --preset default && "
                 "cmake --build --preset default) or pass --strata" % args.strata)
    if shutil.which("mpirun") is None:
        ap.error("mpirun not found on PATH")
    return args


def main():
    args = parse_args()
    work = os.path.abspath(args.nvme_dir)
    swap_dir = os.path.join(work, "swap")
    os.makedirs(work, exist_ok=True)
    tokens = os.path.join(work, "tokens.bin")
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    log("train_offload_bench: %s, %s, %d ranks, %d steps per run (steps 1-%d warm-up), "
        "%d runs per config; load average %.2f"
        % (args.strata, args.model, args.np, args.steps, args.warmup, args.repeat, loadavg()))
    if loadavg() > 0.5:
        log("  note: the load average is above 0.5; other processes will move the numbers")
    try:
        run_checked([args.strata, "data", "synth", "--out", tokens, "--tokens", "4M",
                     "--vocab", "1024", "--seed", "1"], os.path.join(work, "log-synth.txt"),
                    args.timeout)
        for kind in CONFIGS:
            with open(os.path.join(work, "ds_%s.json" % kind), "w") as f:
                json.dump(ds_config(kind, swap_dir, args), f, indent=2)
                f.write("\n")
        runs = {k: [] for k in CONFIGS}
        for rep in range(args.repeat):
            order = CONFIGS if rep % 2 == 0 else tuple(reversed(CONFIGS))
            for kind in order:
                runs[kind].append(train_once(args, kind, rep, work, swap_dir, tokens))
    finally:
        if not args.keep:
            shutil.rmtree(swap_dir, ignore_errors=True)
            if os.path.exists(tokens):
                os.remove(tokens)

    med = {k: summarize(runs[k]) for k in CONFIGS}
    ratio = med["nvme"]["tokens_per_s"] / med["device"]["tokens_per_s"]
    ratio_steps = (med["nvme"]["tokens_per_s_mean_of_steps"]
                   / med["device"]["tokens_per_s_mean_of_steps"])
    csz = 2  # bf16, the compute dtype of both configs
    bucket = args.prefetch_bucket_size if args.prefetch_bucket_size is not None \
        else DEFAULT_PREFETCH_BUCKET
    live = args.max_live_parameters if args.max_live_parameters is not None else DEFAULT_MAX_LIVE
    budget = (bucket + live) * csz
    params = runs["nvme"][0]["parameters"]
    nvme_peak = med["nvme"]["device_peak_bytes"]
    dev_peak = med["device"]["device_peak_bytes"]
    memory_met = nvme_peak <= budget
    speed_met = ratio >= TARGET_RATIO
    # Each repeat's nvme and device runs ran back to back, under much the same outside load.
    pair_ratios = [n["tokens_per_s"] / d["tokens_per_s"]
                   for n, d in zip(runs["nvme"], runs["device"])]
    foreign_max = max(r["foreign_cpus"] for k in CONFIGS for r in runs[k])
    ncpu = os.cpu_count() or 1

    rows = [("tokens/s", "%.0f", "tokens_per_s", 1),
            ("mean of step tokens/s", "%.0f", "tokens_per_s_mean_of_steps", 1),
            ("step s", "%.3f", "step_s", 1),
            ("compute s", "%.3f", "compute_s", 1),
            ("exposed comm s", "%.3f", "exposed_comm_s", 1),
            ("exposed io s", "%.3f", "exposed_io_s", 1),
            ("exposed optim s", "%.3f", "exposed_optimizer_s", 1),
            ("NVMe read MiB/step", "%.1f", "nvme_read_bytes_per_step", MIB),
            ("NVMe write MiB/step", "%.1f", "nvme_write_bytes_per_step", MIB),
            ("prefetch hit rate", "%.2f", "prefetch_hit_rate", 1),
            ("device peak MiB", "%.1f", "device_peak_bytes", MIB),
            ("host (pinned) peak MiB", "%.1f", "host_peak_bytes", MIB),
            ("other processes, CPUs", "%.2f", "foreign_cpus", 1)]
    print("%s, ZeRO-3, bf16, %d ranks on the CPU device, seq %d x %d per rank; steps %d-%d of "
          "%d, median of %d runs" % (args.model, args.np, args.seq_len, args.micro_batch,
                                     args.warmup + 1, args.steps, args.steps, args.repeat))
    print("%-24s %12s %12s" % ("", "nvme", "device"))
    for label, fmt, key, scale in rows:
        print("%-24s %12s %12s" % (label, fmt % (med["nvme"][key] / scale),
                                   fmt % (med["device"][key] / scale)))
    print("tokens/s per run: nvme %s, device %s"
          % (" ".join("%.0f" % x for x in med["nvme"]["tokens_per_s_runs"]),
             " ".join("%.0f" % x for x in med["device"]["tokens_per_s_runs"])))
    print("ratio nvme/device tokens/s: %.3f (of the step means: %.3f); target >= %.2f: %s"
          % (ratio, ratio_steps, TARGET_RATIO, "met" if speed_met else "NOT met"))
    print("per repeat (back-to-back runs): %s; median %.3f"
          % (" ".join("%.3f" % x for x in pair_ratios), statistics.median(pair_ratios)))
    if foreign_max > NOISY_FOREIGN_CPUS:
        print("warning: other processes used up to %.2f of %d CPUs during a run; the ratio "
              "measures that load as much as the offload" % (foreign_max, ncpu))
    print("device memory: nvme peak %.1f MiB, device-memory run peak %.1f MiB; prefetch budget "
          "%.1f MiB = (stage3_prefetch_bucket_size %d + stage3_max_live_parameters %d) x %d B; "
          "activations on the device: 0 B (host memory on the CPU device); within budget: %s"
          % (nvme_peak / MIB, dev_peak / MIB, budget / MIB, bucket, live, csz,
             "yes" if memory_met else "NO"))

    result = {
        "benchmark": "train_offload_bench",
        "time": started,
        "strata": args.strata,
        "model": args.model,
        "parameters": params,
        "world_size": args.np,
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
        "steps": args.steps,
        "warmup_steps": args.warmup,
        "repeat": args.repeat,
        "compute_dtype_bytes": csz,
        "nvme": med["nvme"],
        "device": med["device"],
        "ratio": ratio,
        "ratio_of_step_means": ratio_steps,
        "pair_ratios": pair_ratios,
        "median_pair_ratio": statistics.median(pair_ratios),
        "max_foreign_cpus": foreign_max,
        "cpus": ncpu,
        "target": TARGET_RATIO,
        "met": speed_met,
        "memory": {
            "nvme_device_peak_bytes": nvme_peak,
            "device_run_device_peak_bytes": dev_peak,
            "stage3_prefetch_bucket_size": bucket,
            "stage3_max_live_parameters": live,
            "prefetch_bucket_bytes": bucket * csz,
            "max_live_bytes": live * csz,
            "budget_bytes": budget,
            "model_param_bytes": round(params * csz) if params else None,
            "activation_device_bytes": 0,
            "activations_note": "on the CPU device the model keeps activations in host memory "
                                "outside the device allocator; device_peak_bytes counts the "
                                "engine's device allocations only",
            "within_budget": memory_met,
        },
        "runs": runs["nvme"] + runs["device"],
    }
    text = json.dumps(result, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        die("interrupted")
