#!/usr/bin/python3
"""Tokens/s of `strata train` with ZeRO-3 + NVMe offload against the same run in device memory.

The synthetic job's run (deploy/synthetic-job.sh: llama-20m, ZeRO stage 3, bf16, 4 sequences of 64 tokens
per rank, AdamW, WarmupCosineLR, clipping 1.0, 2 MPI ranks on the CPU device) in two DeepSpeed
configs that differ only in the offload:

  nvme    offload_param and offload_optimizer on "nvme" (as the synthetic job)
  device  offload_param and offload_optimizer "none": every state in device memory

Each configuration runs --repeat times, alternating (nvme, device, device, nvme, ...), each run
`mpirun -np N strata train ... --steps S --metrics FILE`. Per run, the first --warmup steps are
dropped and the rest averaged; per configuration the median over the runs is reported. The
target is tokens/s(nvme) / tokens/s(device) >= 0.85.

Device memory of the NVMe run, two checks (the engine's device allocations; see
benchmarks/README.md and src/zero/engine.cc):

  parameters   param_device_peak_bytes <= param_device_budget_bytes (both from the metrics): the
               tier manager's device tier, i.e. the parameter shards (compute dtype) cached on
               the device. Its budget is min(all shards, max(stage3_prefetch_bucket_size * csz
               + 2 shards, 4 shards)), shards counted at the largest one's size class.
  total        device_peak_bytes <= bound = parameter budget + max_live_bytes (gathered units
               in the compute dtype and per-unit fp32 gradients in flight:
               max(stage3_max_live_parameters * csz, 2 * largest unit * (csz + 4)), plus tied
               units) + the fp32 gradient reduction bucket (world * min(reduce_bucket_size /
               world, the shards that fit) * 4) + units below the persistence threshold kept
               gathered + one 256 B scalar (the loss / norm all-reduce) + the model's
               activations and op workspace (model_device_bytes in the metrics, allocated once
               at set-up). The script computes each engine term from the config and the
               model's shapes the way the engine does.

Gathered units, gradients and the bucket are not "parameters": only the first check is the
prefetch budget. The model's activations are device memory on every device (LlamaModel allocates
them under the device budget), so device_peak_bytes includes them.

Output: progress on stderr; a table and one JSON object on stdout (and in --json FILE). The exit
status is 1 on an error (a run that fails or times out), 2 on bad options, 0 otherwise, whether
or not the target or a memory check was met. Standard library only; run with /usr/bin/python3.

Usage: benchmarks/train_offload_bench.py [--strata build/default/strata]
       [--nvme-dir /work/benchdir/train-bench] [--steps 30] [--repeat 3] [--json out.json]
       [--prefetch-bucket-size N] [--max-live-parameters N] [--reduce-bucket-size N]
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
# corresponding option is not given (the synthetic job sets none of them).
DEFAULT_PREFETCH_BUCKET = 50_000_000
DEFAULT_MAX_LIVE = 1_000_000_000
DEFAULT_REDUCE_BUCKET = 500_000_000
DEFAULT_PERSISTENCE_THRESHOLD = 100_000
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


# ---- the engine's device-memory terms, recomputed from the config and the model's shapes -------
# These mirror src/model/llama_config.cc (presets), src/model/llama_model.cc (units),
# src/zero/partition.cc (layout), device::PinnedPool::SizeClass and Engine::Impl::Init
# (src/zero/engine.cc). The parameter budget computed here is checked against the one the engine
# reports (param_device_budget_bytes); a mismatch means this copy has gone stale.

# name: (vocab, hidden, intermediate, layers, heads, kv_heads, tie_word_embeddings)
LLAMA_PRESETS = {
    "llama-tiny": (256, 64, 160, 2, 4, 2, False),
    "llama-20m": (1024, 384, 1024, 12, 6, 2, False),
}
PARAM_ALIGN_ELEMS = 64     # zero::kParamAlignElems
SHARD_ALIGN_ELEMS = 2048   # zero::kShardAlignElems
DEVICE_ALIGNMENT = 256     # device::kDeviceAlignment (the CPU device rounds requests to it)
SCALAR_SCRATCH_BYTES = DEVICE_ALIGNMENT  # AllReduceHostFloat: one float, one at a time


def round_up(x, m):
    return (x + m - 1) // m * m


def pinned_size_class(n):
    """device::PinnedPool::SizeClass."""
    if n <= 4096:
        return 4096
    if n <= 64 << 10:
        return 1 << (n - 1).bit_length()
    k = (n - 1).bit_length() - 1
    return round_up(n, 1 << (k - 3))


def llama_shape(model):
    """(vocab, hidden, inter, layers, heads, kv_heads, tied) of a preset or a config.json path,
    or None when it cannot be told."""
    if model in LLAMA_PRESETS:
        return LLAMA_PRESETS[model]
    path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    try:
        with open(path) as f:
            c = json.load(f)
        return (c["vocab_size"], c["hidden_size"], c["intermediate_size"],
                c["num_hidden_layers"], c["num_attention_heads"],
                c.get("num_key_value_heads") or c["num_attention_heads"],
                bool(c.get("tie_word_embeddings", False)))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def llama_units(shape):
    """Per unit (embed, layers.0..L-1, head): the parameter sizes in elements, in slot order."""
    vocab, h, inter, layers, heads, kv_heads, tied = shape
    kv = h // heads * kv_heads
    units = [("embed", [vocab * h])]
    for i in range(layers):
        units.append(("layers.%d" % i, [h, h * h, kv * h, kv * h, h * h, h, inter * h,
                                       inter * h, h * inter]))
    units.append(("head", [h] if tied else [h, vocab * h]))
    return units


def unit_layout(sizes, world):
    """(numel, shard_numel, padded_numel) as zero::LayoutUnit lays the unit out."""
    offset = 0
    for n in sizes:
        offset = round_up(offset, PARAM_ALIGN_ELEMS) + n
    shard = round_up(-(-offset // world), SHARD_ALIGN_ELEMS)
    return sum(sizes), shard, shard * world


def engine_device_terms(shape, world, csz, prefetch_bucket, max_live_params, reduce_bucket,
                        persistence_threshold):
    """The NVMe run's device-memory terms (bytes, per rank) as Engine::Impl::Init sizes them."""
    units = llama_units(shape)
    lay = [unit_layout(sizes, world) for _, sizes in units]
    held = [pinned_size_class(shard * csz) for _, shard, _ in lay]
    shard_total, shard_largest = sum(held), max(held)
    # Parameter shards cached on the device (the tier manager's device budget, offloaded home).
    resident = max(shard_total, 4 * shard_largest)
    lookahead = max(prefetch_bucket, 0) * csz
    param_budget = min(resident, max(lookahead + 2 * shard_largest, 4 * shard_largest))
    # Gathered units (compute dtype) and per-unit fp32 gradients in flight (LiveBuffers::Alloc).
    largest_unit = max(p for _, _, p in lay) * (csz + 4)
    tied = lay[0][2] * (4 + 8) if shape[6] else 0  # the head holds the embedding gathered + grad
    max_live = max(max_live_params * csz, 2 * largest_unit) + tied
    # The fp32 reduction bucket (stages 2-3, world > 1).
    bucket = 0
    if world > 1:
        per_rank = max(reduce_bucket // world, 1)
        small = sum(shard for _, shard, _ in lay if shard <= per_rank)
        cap = min(per_rank, small)
        if cap > 0 and len(lay) > 1:
            bucket = round_up(cap * world * 4, DEVICE_ALIGNMENT)
    # Units below stage3_param_persistence_threshold stay gathered for the step, outside
    # LiveBuffers::Alloc.
    persistent = sum(p * csz for numel, _, p in lay if numel < persistence_threshold)
    bound = param_budget + max_live + bucket + persistent + SCALAR_SCRATCH_BYTES
    return {
        "units": len(lay),
        "model_parameters": sum(numel for numel, _, _ in lay),
        "param_shard_bytes_all": shard_total,
        "param_shard_bytes_largest": shard_largest,
        "param_device_budget_bytes": param_budget,
        "largest_unit_gathered_plus_grad_bytes": largest_unit,
        "max_live_bytes": max_live,
        "reduce_bucket_bytes": bucket,
        "persistent_unit_bytes": persistent,
        "scalar_scratch_bytes": SCALAR_SCRATCH_BYTES,
        "bound_bytes": bound,
    }


def ds_config(kind, swap_dir, args):
    zero = {"stage": 3, "sub_group_size": 1000000}
    if kind == "nvme":
        zero["offload_param"] = {"device": "nvme", "nvme_path": swap_dir}
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": swap_dir,
                                     "buffer_count": args.buffer_count}
    else:
        zero["offload_param"] = {"device": "none"}
        zero["offload_optimizer"] = {"device": "none"}
    if args.prefetch_bucket_size is not None:
        zero["stage3_prefetch_bucket_size"] = args.prefetch_bucket_size
    if args.max_live_parameters is not None:
        zero["stage3_max_live_parameters"] = args.max_live_parameters
    if args.reduce_bucket_size is not None:
        zero["reduce_bucket_size"] = args.reduce_bucket_size
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
        "strata": {"memory": {"share_host_memory": args.share_host_memory}},
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
        # The tier manager's device tier: parameter shards cached on the device, and its budget.
        "param_device_peak_bytes": max(s.get("param_device_peak_bytes", 0) for s in steps),
        "param_device_budget_bytes": last.get("param_device_budget_bytes"),
        "host_peak_bytes": max(s["host_peak_bytes"] for s in steps),
        # The model's activations and op workspace, device memory held from set-up on.
        "model_device_bytes": last.get("model_device_bytes", 0),
        "final_loss": last["loss"],
        "parameters": params,
        "metrics_file": metrics,
    }
    log("  %-6s run %d: %.0f tok/s (step %.3f s, exposed io %.3f s), device peak %.1f MiB "
        "(parameter shards %.1f of %.1f MiB), %.0f s wall, other processes %.2f CPUs"
        % (kind, rep + 1, r["tokens_per_s"], r["step_s"], r["exposed_io_s"],
           r["device_peak_bytes"] / MIB, r["param_device_peak_bytes"] / MIB,
           (r["param_device_budget_bytes"] or 0) / MIB, wall, foreign))
    return r


def summarize(runs):
    keys = ["tokens_per_s", "tokens_per_s_mean_of_steps", "step_s", "compute_s", "exposed_comm_s",
            "exposed_io_s", "exposed_optimizer_s", "nvme_read_bytes_per_step",
            "nvme_write_bytes_per_step", "prefetch_hit_rate", "foreign_cpus"]
    out = {k: statistics.median([r[k] for r in runs]) for k in keys}
    out["tokens_per_s_runs"] = [r["tokens_per_s"] for r in runs]
    out["device_peak_bytes"] = max(r["device_peak_bytes"] for r in runs)
    out["param_device_peak_bytes"] = max(r["param_device_peak_bytes"] for r in runs)
    budgets = {r["param_device_budget_bytes"] for r in runs}
    out["param_device_budget_bytes"] = budgets.pop() if len(budgets) == 1 else None
    out["host_peak_bytes"] = max(r["host_peak_bytes"] for r in runs)
    out["model_device_bytes"] = max(r["model_device_bytes"] for r in runs)
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
                         "unset, as in the synthetic job: %d)" % DEFAULT_PREFETCH_BUCKET)
    ap.add_argument("--max-live-parameters", type=int, default=None,
                    help="stage3_max_live_parameters in elements, in both configs (default: "
                         "unset, as in the synthetic job: %d)" % DEFAULT_MAX_LIVE)
    ap.add_argument("--reduce-bucket-size", type=int, default=None,
                    help="reduce_bucket_size in elements, in both configs (default: unset, as "
                         "in the synthetic job: %d)" % DEFAULT_REDUCE_BUCKET)
    ap.add_argument("--buffer-count", type=int, default=8,
                    help="offload_optimizer.buffer_count of the nvme run: optimizer sub-groups "
                         "in host memory at once (default 8, as the synthetic job)")
    ap.add_argument("--share-host-memory", choices=["auto", "on", "off"], default="auto",
                    help="strata.memory.share_host_memory in both configs (default auto: the CPU "
                         "device reads offloaded parameter shards in place in pinned host memory)")
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
    for name in ("prefetch_bucket_size", "max_live_parameters", "reduce_bucket_size"):
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
    prefetch = args.prefetch_bucket_size if args.prefetch_bucket_size is not None \
        else DEFAULT_PREFETCH_BUCKET
    live = args.max_live_parameters if args.max_live_parameters is not None else DEFAULT_MAX_LIVE
    rbucket = args.reduce_bucket_size if args.reduce_bucket_size is not None \
        else DEFAULT_REDUCE_BUCKET
    params = runs["nvme"][0]["parameters"]
    nvme_peak = med["nvme"]["device_peak_bytes"]
    dev_peak = med["device"]["device_peak_bytes"]
    param_peak = med["nvme"]["param_device_peak_bytes"]
    param_budget = med["nvme"]["param_device_budget_bytes"]  # as the engine reports it
    param_met = param_budget is not None and param_peak <= param_budget
    shape = llama_shape(args.model)
    terms = (engine_device_terms(shape, args.np, csz, prefetch, live, rbucket,
                                 DEFAULT_PERSISTENCE_THRESHOLD) if shape else None)
    if terms:
        # The model's activations live in device memory too (allocated once at set-up).
        terms["model_device_bytes"] = med["nvme"]["model_device_bytes"]
        terms["bound_bytes"] += terms["model_device_bytes"]
    bound = terms["bound_bytes"] if terms else None
    total_met = bound is not None and nvme_peak <= bound
    # The script's copy of the engine's sizing agrees with the engine (checked on the one term
    # the engine reports).
    terms_agree = terms is not None and terms["param_device_budget_bytes"] == param_budget
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
    print("device memory per rank of the nvme run (the engine's device allocations; activations: "
          "0 B, the CPU device keeps them in host memory):")
    print("  parameters (bf16 shards cached on the device, the tier manager's device tier): peak "
          "%.2f MiB, budget %s (stage3_prefetch_bucket_size %d x %d B lookahead + 2 shards, at "
          "least 4, at most all of the rank's shards); within: %s"
          % (param_peak / MIB, "%.2f MiB" % (param_budget / MIB) if param_budget is not None
             else "unknown (the runs differ)", prefetch, csz, "yes" if param_met else "NO"))
    if terms:
        print("  total: peak %.2f MiB; bound %.2f MiB = parameter budget %.2f + live gathered units "
              "and fp32 unit gradients %.2f (max(stage3_max_live_parameters %d x %d B, 2 x "
              "largest unit %.2f)) + fp32 gradient reduction bucket %.2f (reduce_bucket_size %d) "
              "+ persistent units %.2f + scalar %d B + model activations %.2f; within: %s"
              % (nvme_peak / MIB, bound / MIB, terms["param_device_budget_bytes"] / MIB,
                 terms["max_live_bytes"] / MIB, live, csz,
                 terms["largest_unit_gathered_plus_grad_bytes"] / MIB,
                 terms["reduce_bucket_bytes"] / MIB, rbucket, terms["persistent_unit_bytes"] / MIB,
                 terms["scalar_scratch_bytes"], terms["model_device_bytes"] / MIB,
                 "yes" if total_met else "NO"))
        if not terms_agree:
            print("  warning: the parameter budget computed here (%d B) differs from the engine's "
                  "(%s B); the script's copy of the engine's sizing is stale"
                  % (terms["param_device_budget_bytes"], param_budget))
    else:
        print("  total: peak %.2f MiB; no bound (the shapes of --model %s are unknown to the "
              "script)" % (nvme_peak / MIB, args.model))
    print("  only the first line is parameters; of the rest, gathered units are transient bf16 "
          "copies of parameters and the unit gradients and the bucket are fp32 gradient buffers")
    print("device memory per rank of the device run: peak %.2f MiB (all parameter shards, fp32 "
          "master weights, Adam moments and gradient shards, plus the buffers above)"
          % (dev_peak / MIB))

    result = {
        "benchmark": "train_offload_bench",
        "time": started,
        "strata": args.strata,
        "share_host_memory": args.share_host_memory,
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
            "stage3_prefetch_bucket_size": prefetch,
            "stage3_max_live_parameters": live,
            "reduce_bucket_size": rbucket,
            "stage3_param_persistence_threshold": DEFAULT_PERSISTENCE_THRESHOLD,
            # Parameters: the tier manager's device tier (cached bf16 shards), from the metrics.
            "param_device_peak_bytes": param_peak,
            "param_device_budget_bytes": param_budget,
            "params_within_budget": param_met,
            # Every device allocation of the nvme run against the sum of the engine's bounds.
            "engine_terms": terms,
            "engine_terms_agree": terms_agree,
            "bound_bytes": bound,
            "total_within_bound": total_met,
            "model_param_bytes": round(params * csz) if params else None,
            "activation_device_bytes": 0,
            "note": "only param_device_* are parameters; max_live_bytes holds transient gathered "
                    "bf16 units and fp32 unit gradients, reduce_bucket_bytes is an fp32 gradient "
                    "buffer. On the CPU device the model keeps activations in host memory "
                    "outside the device allocator; device_peak_bytes counts the engine's device "
                    "allocations only",
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
