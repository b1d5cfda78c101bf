#!/usr/bin/env python3
"""gpu_train_bench.py: `strata train` on a GPU against PyTorch on the same machine.

One model (a Hugging Face Llama config.json this script writes: --model llama-1b is TinyLlama's
1.1B shape, llama-tiny the 0.1M test model), random tokens from `strata data synth`, one
micro-batch of --micro-batch sequences of --seq-len tokens per step, AdamW, bf16 (with --bf16).
Scenarios (--scenarios, comma-separated):

  hbm        Strata ZeRO stage 0, parameters, gradients and optimizer in HBM (fused AdamW on
             the GPU), against PyTorch eager (train_peers.py eager). Target: tokens/s ratio
             >= 1.1 (issue 40). Also reports TFLOPS (the trainer's 6N + attention FLOPs per token) and the
             model FLOPs utilisation against --peak-tflops.
  cpu-optim  Strata ZeRO stage 2 with offload_optimizer "cpu" (gradients leave by D2H into the
             pinned pool, AdamW on the CPU, parameters return by H2D), against PyTorch FSDP2
             with CPUOffloadPolicy (train_peers.py fsdp2-offload). Target: tokens/s >= 2x. With
             --deepspeed-python also against DeepSpeed ZeRO-3 with offload_optimizer "cpu"
             (ZeRO-Offload, train_peers.py deepspeed-offload). Target: >= 1.5x.
  nvme       Strata ZeRO stage 3 with parameters and optimizer on NVMe (--nvme-dir). Reported
             against its floor: max(compute only = the hbm scenario's step time (or
             --compute-s), PCIe = the bytes stage 3 moves per parameter (two gathers in the
             compute dtype, one fp32 gradient) / --pcie-gbs, NVMe = bytes read per step /
             --nvme-read-gbs + bytes written / --nvme-write-gbs (one drive serves both),
             CPU Adam = the cpu-optim scenario's exposed optimizer time).
             Terms whose input was not measured in this run are left out and named. Target:
             step time / floor <= 1.15. With --deepspeed-python also against DeepSpeed ZeRO-3
             with parameters and optimizer on NVMe (ZeRO-Infinity, train_peers.py
             deepspeed-infinity, its "aio" section from --aio). Target: tokens/s >= 2x.
  largest    Strata ZeRO stage 3 with both homes "auto": the placement planner chooses where
             parameters and optimizer states live on this machine (HBM, host memory, --nvme-dir,
             or the states split between HBM and the host with offload_optimizer.ratio), with
             full AdamW. Run with the largest --model to try (llama3-8b: Llama-3-8B's shape,
             8.03B parameters) and --micro-batch 1. Target: the model has >= 8e9 parameters and
             trains (exit 0, every loss finite); reported: the planner's choice, tokens/s.
  custom     Strata with the zero_optimization object given by --zero (a placement to check
             by hand, e.g. the one the planner chose for a larger model); reported: its losses
             and step time, no peer.

Each Strata run is `strata train --device <--device> ... --steps --steps --metrics FILE`; the
first --warmup steps are left out and the median of the rest is reported. A scenario whose run
fails is reported with its error and does not stop the others. Each run (Strata's, a peer's) gets
--timeout seconds; with --deadline SEC, also no more than what is left of SEC seconds from the
start (less 10 s for the estimates and the output), and a run left under 10 s is reported as not
run: a caller with a time budget (deploy/gpu-check.sh) then gets every result that finished, the
slower peers cut first (each scenario runs Strata first).

Against `strata estimate` (issue 20's check on a GPU): for hbm, cpu-optim and nvme, the same
config's estimate (--gpus 1, this run's --pcie-gbs and NVMe rates, --cpu-adam-gps) beside the
run: the device peak (measured / estimated; the memory model is exact, target within 5%) and the
step time (estimated / measured, target within 25%), the compute rate calibrated once from the
hbm run (its measured compute time against the estimate's at --peak-tflops, as --gpu-efficiency).

Output: progress on stderr; a table and one JSON object on stdout (and --json FILE). Exit
status: 0 when every run that was attempted finished (targets met or not), 1 when one failed, 2
for bad options. Standard library only; the peer runs under --python (a python3 with torch).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Hugging Face config.json fields of the models this benchmark knows.
MODELS = {
    # TinyLlama-1.1B's shape.
    "llama-1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                     num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                     max_position_embeddings=4096),
    # Llama-3-8B's shape (8.03B parameters): the largest-model scenario's.
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      max_position_embeddings=8192, rope_theta=500000.0),
    "llama-tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256),
}


def parameter_count(name):
    m = MODELS[name]
    h, inter, v = m["hidden_size"], m["intermediate_size"], m["vocab_size"]
    kv = h // m["num_attention_heads"] * m["num_key_value_heads"]
    per_layer = 2 * h + 2 * h * h + 2 * kv * h + 3 * h * inter
    return 2 * v * h + h + m["num_hidden_layers"] * per_layer


def strata_env():
    """The environment of strata runs: STRATA_LD_LIBRARY_PATH, when set, becomes their
    LD_LIBRARY_PATH (deploy/gpu-check.sh runs carried binaries; the peer keeps this machine's)."""
    env = dict(os.environ)
    if env.get("STRATA_LD_LIBRARY_PATH"):
        env["LD_LIBRARY_PATH"] = env["STRATA_LD_LIBRARY_PATH"]
    return env


def log(msg):
    print("gpu_train_bench: " + msg, file=sys.stderr, flush=True)


def write_model(work, name):
    d = os.path.join(work, "model-" + name)
    os.makedirs(d, exist_ok=True)
    cfg = dict(dict(rope_theta=10000.0), **MODELS[name])
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama", rms_norm_eps=1e-5,
               tie_word_embeddings=False, hidden_act="silu", torch_dtype="float32")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return d


def ds_config(scenario, args):
    cfg = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW",
                         "params": {"lr": args.lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                    "weight_decay": 0.0}}}
    if args.bf16:
        cfg["bf16"] = {"enabled": True}
    if scenario == "hbm":
        cfg["zero_optimization"] = {"stage": 0}
    elif scenario == "cpu-optim":
        cfg["zero_optimization"] = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    elif scenario == "largest":
        nvme = os.path.join(args.nvme_dir, "swap-largest")
        cfg["zero_optimization"] = {
            "stage": 3, "stage3_max_live_parameters": 300_000_000,
            "offload_param": {"device": "auto", "nvme_path": nvme},
            "offload_optimizer": {"device": "auto", "nvme_path": nvme}}
    elif scenario == "custom":
        cfg["zero_optimization"] = json.loads(args.zero)
    else:
        nvme = os.path.join(args.nvme_dir, "swap")
        cfg["zero_optimization"] = {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": nvme},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme}}
    return cfg


class Streamed:
    def __init__(self, returncode, stdout, stderr, timed_out):
        self.returncode, self.stdout, self.stderr, self.timed_out = (
            returncode, stdout, stderr, timed_out)


# Seconds kept back from --deadline for what follows the runs (the estimates, the output), and the
# least a run is started with.
DEADLINE_RESERVE_S = 10
MIN_RUN_S = 10
STARTED = time.monotonic()


def run_timeout(args, wanted):
    """The timeout of the next run: `wanted` seconds, cut to what --deadline leaves; None when
    that is under MIN_RUN_S (the run is then not started)."""
    if not args.deadline:
        return wanted
    left = int(args.deadline - (time.monotonic() - STARTED)) - DEADLINE_RESERVE_S
    return min(wanted, left) if left >= MIN_RUN_S else None


def out_of_time(args):
    left = max(0, int(args.deadline - (time.monotonic() - STARTED)))
    return {"error": f"not run: {left} s of --deadline {args.deadline} left (a run needs "
                     f"{MIN_RUN_S} s, and {DEADLINE_RESERVE_S} s are kept for the output)"}


def run_streaming(cmd, timeout, env):
    """Runs cmd, echoing its output to stderr line by line as it comes (so that a run cut off by
    an outer timeout still shows how far it got), and keeps it; kills it after `timeout` s."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, bufsize=1)
    out, err = [], []

    def pump(stream, keep):
        for line in stream:
            keep.append(line)
            sys.stderr.write(line)
            sys.stderr.flush()

    threads = [threading.Thread(target=pump, args=(proc.stdout, out), daemon=True),
               threading.Thread(target=pump, args=(proc.stderr, err), daemon=True)]
    for t in threads:
        t.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        proc.kill()
        proc.wait()
    for t in threads:
        t.join(timeout=5)
    return Streamed(proc.returncode, "".join(out), "".join(err), timed_out)


def run_strata(scenario, args, model_dir, data, work):
    path = os.path.join(work, f"ds-{scenario}.json")
    with open(path, "w") as f:
        json.dump(ds_config(scenario, args), f, indent=1)
    metrics = os.path.join(work, f"metrics-{scenario}.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    if scenario in ("nvme", "largest"):
        swap = os.path.join(args.nvme_dir, "swap" if scenario == "nvme" else "swap-largest")
        shutil.rmtree(swap, ignore_errors=True)
        os.makedirs(swap, exist_ok=True)
    cmd = [args.strata, "train", "--config", path, "--model", model_dir, "--data", data,
           "--seq-len", str(args.seq_len), "--steps", str(args.steps), "--device", args.device,
           "--sampling", "sequential", "--metrics", metrics]
    if scenario == "hbm":
        # Where the compute goes, per op (two stream-ordered timestamps per op: ~1% of a step).
        cmd.append("--profile-ops")
    timeout = run_timeout(args, args.timeout)
    if timeout is None:
        return out_of_time(args)
    log("+ " + " ".join(cmd))
    t0 = time.monotonic()
    r = run_streaming(cmd, timeout, strata_env())
    wall = time.monotonic() - t0
    if r.timed_out:
        return {"error": f"timed out after {timeout} s; last output: "
                         f"{(r.stdout + r.stderr).strip()[-300:]}"}
    if r.returncode != 0:
        return {"error": f"exit status {r.returncode}: {r.stderr.strip()[-500:]}"}
    steps = [json.loads(line) for line in open(metrics) if line.strip()]
    measured = steps[args.warmup:]
    if not measured:
        return {"error": f"{metrics} holds {len(steps)} steps, none after the warm-up"}
    med = lambda k: statistics.median(s[k] for s in measured)
    out = {"step_s": med("step_s"), "tokens_per_s": med("tokens_per_s"), "tflops": med("tflops"),
           "compute_s": med("compute_s"), "exposed_io_s": med("exposed_io_s"),
           "exposed_optimizer_s": med("exposed_optimizer_s"),
           "nvme_bytes_per_step": med("nvme_read_bytes") + med("nvme_write_bytes"),
           "nvme_read_bytes_per_step": med("nvme_read_bytes"),
           "nvme_write_bytes_per_step": med("nvme_write_bytes"),
           "device_peak_bytes": max(s["device_peak_bytes"] for s in steps),
           "host_peak_bytes": max(s["host_peak_bytes"] for s in steps),
           "model_device_bytes": steps[-1].get("model_device_bytes", 0),
           "losses": [s["loss"] for s in steps], "wall_s": wall}
    placement = []
    for line in r.stdout.splitlines():
        if line.strip().startswith("device:"):
            out["device_line"] = line.strip()
        if line.strip().startswith(("chosen:", "strata train: model")):
            placement.append(line.strip())
    if placement:
        out["placement"] = placement
    lines = r.stdout.splitlines()
    first = next((i for i, l in enumerate(lines) if l.startswith("op profile:")), None)
    if first is not None:
        out["op_profile"] = [l for l in lines[first:] if l.startswith(("op profile:", "  "))]
    return out


def run_estimate(scenario, args, model_dir, work, efficiency):
    """`strata estimate --json` for the config run_strata wrote for `scenario`."""
    cmd = [args.strata, "estimate", "--model", model_dir, "--config",
           os.path.join(work, f"ds-{scenario}.json"), "--seq-len", str(args.seq_len),
           "--device", args.device, "--gpus", "1", "--json",
           "--gpu-tflops", f"{args.peak_tflops:.6g}", "--gpu-efficiency", f"{efficiency:.6g}"]
    if args.pcie_gbs > 0:
        cmd += ["--pcie", f"{args.pcie_gbs * 1e9:.6g}"]
    if args.nvme_read_gbs > 0 and args.nvme_write_gbs > 0:
        cmd += ["--nvme-read", f"{args.nvme_read_gbs * 1e9:.6g}",
                "--nvme-write", f"{args.nvme_write_gbs * 1e9:.6g}"]
    if args.cpu_adam_gps > 0:
        cmd += ["--cpu-adam", f"{args.cpu_adam_gps * 1e9:.6g}"]
    timeout = run_timeout(args, 120)
    if timeout is None:
        return out_of_time(args)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=strata_env())
    except subprocess.TimeoutExpired:
        return {"error": f"strata estimate timed out after {timeout} s"}
    if r.returncode != 0:
        return {"error": f"strata estimate exited {r.returncode}: {r.stderr.strip()[-300:]}"}
    e = json.loads(r.stdout)
    return {"device_peak_bytes": e["device"]["peak_bytes"], "step_s": e["time"]["step_s"],
            "compute_s": e["time"]["compute_s"], "bottleneck": e["time"].get("bottleneck", "")}


def compare_estimates(results, args, model_dir, work):
    """Adds results[s]["estimate"] for each Strata run of hbm / cpu-optim / nvme."""
    hbm = results.get("hbm", {}).get("strata", {})
    efficiency = 0.5
    if "compute_s" in hbm and hbm["compute_s"] > 0:
        at_peak = run_estimate("hbm", args, model_dir, work, 1.0)
        if "compute_s" in at_peak:
            efficiency = min(1.0, max(0.01, at_peak["compute_s"] / hbm["compute_s"]))
    for s in ("hbm", "cpu-optim", "nvme"):
        st = results.get(s, {}).get("strata", {})
        if "step_s" not in st:
            continue
        e = run_estimate(s, args, model_dir, work, efficiency)
        if "error" not in e:
            e["gpu_efficiency"] = efficiency
            e["device_peak_ratio"] = st["device_peak_bytes"] / max(e["device_peak_bytes"], 1)
            e["step_ratio"] = e["step_s"] / st["step_s"]
            e["device_peak_within_5pct"] = abs(e["device_peak_ratio"] - 1) <= 0.05
            e["step_within_25pct"] = abs(e["step_ratio"] - 1) <= 0.25
        results[s]["estimate"] = e


def run_peer(mode, args, model_dir, python=None, extra=()):
    cmd = [python or args.python, os.path.join(REPO, "benchmarks", "train_peers.py"), mode, "--config",
           os.path.join(model_dir, "config.json"), "--seq-len", str(args.seq_len),
           "--micro-batch", str(args.micro_batch), "--steps", str(args.steps), "--warmup",
           str(args.warmup), "--lr", str(args.lr), "--device", args.device]
    if args.bf16:
        cmd.append("--bf16")
    cmd += list(extra)
    timeout = run_timeout(args, args.timeout)
    if timeout is None:
        return out_of_time(args)
    log("+ " + " ".join(cmd))
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    sys.stderr.write(r.stderr[-2000:])
    if r.returncode == 2:
        return {"skipped": r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "skipped"}
    if r.returncode != 0:
        return {"error": f"exit status {r.returncode}: {r.stderr.strip()[-500:]}"}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--strata", default=os.path.join(REPO, "build", "default", "strata"))
    ap.add_argument("--python", default="python3", help="the interpreter with torch for the peer")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--model", default="llama-1b", choices=sorted(MODELS))
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--scenarios", default="hbm,cpu-optim,nvme")
    ap.add_argument("--work", default="/tmp/strata-gpu-train-bench")
    ap.add_argument("--nvme-dir", default=None, help="NVMe scratch (default: --work)")
    ap.add_argument("--pcie-gbs", type=float, default=0.0,
                    help="host<->device GB/s measured in this run (strata_gpu_bench copy)")
    ap.add_argument("--nvme-read-gbs", type=float, default=0.0,
                    help="NVMe read GB/s measured in this run (strata nvme-bench)")
    ap.add_argument("--nvme-write-gbs", type=float, default=0.0,
                    help="NVMe write GB/s measured in this run (strata nvme-bench)")
    ap.add_argument("--cpu-adam-gps", type=float, default=0.0,
                    help="CPU AdamW G parameters/s for the estimate (default: strata estimate's)")
    ap.add_argument("--no-estimate", action="store_true",
                    help="skip the comparison with strata estimate")
    ap.add_argument("--compute-s", type=float, default=0.0,
                    help="the nvme floor's compute term when hbm is not among --scenarios: the "
                         "hbm scenario's step_s from an earlier run on this machine")
    ap.add_argument("--peak-tflops", type=float, default=989.0,
                    help="the GPU's dense bf16 peak for MFU (H100 SXM: 989)")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per run")
    ap.add_argument("--deadline", type=int, default=0,
                    help="seconds for the whole benchmark: each run's timeout is cut to what is "
                         "left of them (less 10 s), and a run left under 10 s is not started")
    ap.add_argument("--json", default=None)
    ap.add_argument("--deepspeed-python", default=None,
                    help="a python that imports deepspeed: cpu-optim and nvme also run DeepSpeed "
                         "ZeRO-Offload and ZeRO-Infinity")
    ap.add_argument("--aio", default=None,
                    help="DeepSpeed's \"aio\" section (JSON) for ZeRO-Infinity")
    ap.add_argument("--zero", default=None,
                    help="the zero_optimization object (JSON) of the custom scenario")
    args = ap.parse_args()
    scenarios = [s for s in args.scenarios.split(",") if s]
    for s in scenarios:
        if s not in ("hbm", "cpu-optim", "nvme", "largest", "custom"):
            ap.error(f"--scenarios: unknown scenario '{s}' (hbm, cpu-optim, nvme, largest, custom)")
    if "custom" in scenarios:
        try:
            json.loads(args.zero or "")
        except ValueError as e:
            ap.error(f"--scenarios custom needs --zero with a zero_optimization object: {e}")
    if args.steps <= args.warmup:
        ap.error("--steps must exceed --warmup")
    if not os.access(args.strata, os.X_OK):
        ap.error(f"--strata {args.strata}: not an executable")
    args.nvme_dir = args.nvme_dir or args.work
    os.makedirs(args.work, exist_ok=True)

    model_dir = write_model(args.work, args.model)
    data = os.path.join(args.work, "tokens.bin")
    tokens = max(args.steps * args.micro_batch * (args.seq_len + 1) * 2, 100_000)
    subprocess.run([args.strata, "data", "synth", "--out", data, "--tokens", str(tokens),
                    "--vocab", str(MODELS[args.model]["vocab_size"])], check=True,
                   capture_output=True, env=strata_env())

    results = {}
    for s in scenarios:
        results[s] = {"strata": run_strata(s, args, model_dir, data, args.work)}
        if s == "hbm":
            results[s]["pytorch"] = run_peer("eager", args, model_dir)
        elif s == "cpu-optim":
            results[s]["pytorch"] = run_peer("fsdp2-offload", args, model_dir)
        if args.deepspeed_python and s in ("cpu-optim", "nvme"):
            if s == "cpu-optim":
                results[s]["deepspeed"] = run_peer("deepspeed-offload", args, model_dir,
                                                   args.deepspeed_python)
            else:
                ds_dir = os.path.join(args.nvme_dir, "deepspeed-swap")
                shutil.rmtree(ds_dir, ignore_errors=True)
                os.makedirs(ds_dir)
                extra = ["--nvme-dir", ds_dir] + (["--aio", args.aio] if args.aio else [])
                results[s]["deepspeed"] = run_peer("deepspeed-infinity", args, model_dir,
                                                   args.deepspeed_python, extra)
                shutil.rmtree(ds_dir, ignore_errors=True)
    failed = any("error" in r.get("strata", {}) or "error" in r.get("pytorch", {})
                 for r in results.values())
    # DeepSpeed's ratios: Strata's tokens/s over DeepSpeed's in the same run (its failure is
    # reported, not a failed benchmark: its JIT-built ops may not build on a machine).
    ds_rows = []
    for s, name, target in (("cpu-optim", "cpu-optim vs DeepSpeed ZeRO-Offload", 1.5),
                            ("nvme", "nvme vs DeepSpeed ZeRO-Infinity", 2.0)):
        ds = results.get(s, {}).get("deepspeed")
        if ds is None:
            continue
        st = results[s]["strata"]
        r = (st["tokens_per_s"] / ds["tokens_per_s"]
             if "tokens_per_s" in st and "tokens_per_s" in ds else None)
        results[s]["deepspeed_ratio"] = r
        results[s]["deepspeed_target"] = target
        results[s]["deepspeed_met"] = r is not None and r >= target
        ds_rows.append((name, s, r, f">= {target}"))
    if not args.no_estimate:
        compare_estimates(results, args, model_dir, args.work)
    if "largest" in results:
        st = results["largest"]["strata"]
        params = parameter_count(args.model)
        trained = "losses" in st and all(x == x and abs(x) != float("inf") for x in st["losses"])
        st["parameters"] = params
        st["trained"] = trained
        results["largest"]["ratio"] = params / 8e9  # parameters against the 8B target
        results["largest"]["target"] = 1.0
        results["largest"]["met"] = trained and params >= 8e9

    rows = []
    def ratio(s, target):
        st, pt = results[s]["strata"], results[s].get("pytorch", {})
        if "tokens_per_s" not in st or "tokens_per_s" not in pt:
            return None
        r = st["tokens_per_s"] / pt["tokens_per_s"]
        results[s]["ratio"] = r
        results[s]["target"] = target
        results[s]["met"] = r >= target
        return r
    if "hbm" in results:
        r = ratio("hbm", 1.1)
        st = results["hbm"]["strata"]
        if "tflops" in st:
            st["mfu"] = st["tflops"] / args.peak_tflops
        rows.append(("hbm vs PyTorch eager", r, ">= 1.1"))
    if "cpu-optim" in results:
        rows.append(("cpu-optim vs FSDP2 CPUOffload", ratio("cpu-optim", 2.0), ">= 2.0"))
    if "largest" in results:
        rows.append(("largest (parameters / 8e9)", results["largest"]["ratio"], ">= 1.0"))
    if "nvme" in results and "step_s" in results["nvme"]["strata"]:
        st = results["nvme"]["strata"]
        terms, missing = {}, []
        if "hbm" in results and "step_s" in results["hbm"]["strata"]:
            terms["compute"] = results["hbm"]["strata"]["step_s"]
        elif args.compute_s > 0:
            terms["compute"] = args.compute_s
        else:
            missing.append("compute (no hbm run)")
        if args.nvme_read_gbs > 0 and args.nvme_write_gbs > 0:
            terms["nvme"] = (st["nvme_read_bytes_per_step"] / (args.nvme_read_gbs * 1e9) +
                             st["nvme_write_bytes_per_step"] / (args.nvme_write_gbs * 1e9))
        else:
            missing.append("nvme (no --nvme-read-gbs / --nvme-write-gbs)")
        if args.pcie_gbs > 0:
            # Per parameter and step: gathered to the device for forward and again for backward
            # (2 x 2 B in bf16, 2 x 4 B in fp32) and its fp32 gradient back to the host (4 B).
            csz = 2 if args.bf16 else 4
            terms["pcie"] = parameter_count(args.model) * (2 * csz + 4) / (args.pcie_gbs * 1e9)
        else:
            missing.append("pcie (no --pcie-gbs)")
        if "cpu-optim" in results and "exposed_optimizer_s" in results["cpu-optim"]["strata"]:
            terms["cpu_adam"] = results["cpu-optim"]["strata"]["exposed_optimizer_s"]
        else:
            missing.append("cpu adam (no cpu-optim run)")
        floor = max(terms.values()) if terms else None
        results["nvme"]["floor_terms_s"] = terms
        results["nvme"]["floor_missing"] = missing
        if floor:
            results["nvme"]["ratio"] = st["step_s"] / floor
            results["nvme"]["target"] = 1.15
            results["nvme"]["met"] = results["nvme"]["ratio"] <= 1.15
        rows.append(("nvme step / floor", results["nvme"].get("ratio"), "<= 1.15"))

    print(f"gpu_train_bench: model {args.model}, seq {args.seq_len} x micro-batch "
          f"{args.micro_batch}, {'bf16' if args.bf16 else 'fp32'}, device {args.device}")
    print(f"{'scenario':<32} {'strata tok/s':>13} {'peer tok/s':>11} {'ratio':>7} {'target':>8}")
    for (name, r, target), s in zip(rows, [k for k in ("hbm", "cpu-optim", "largest", "nvme")
                                           if k in results]):
        st, pt = results[s]["strata"], results[s].get("pytorch", {})
        fmt = lambda d: f"{d['tokens_per_s']:.0f}" if "tokens_per_s" in d else \
            ("skipped" if "skipped" in d else ("error" if "error" in d else "-"))
        print(f"{name:<32} {fmt(st):>13} {fmt(pt):>11} "
              f"{(f'{r:.2f}' if r is not None else '-'):>7} {target:>8}")
    for name, s, r, target in ds_rows:
        st, ds = results[s]["strata"], results[s]["deepspeed"]
        fmt = lambda d: f"{d['tokens_per_s']:.0f}" if "tokens_per_s" in d else \
            ("skipped" if "skipped" in d else ("error" if "error" in d else "-"))
        print(f"{name:<32} {fmt(st):>13} {fmt(ds):>11} "
              f"{(f'{r:.2f}' if r is not None else '-'):>7} {target:>8}")
        if "deepspeed" in ds:
            print(f"  {s}: DeepSpeed {ds['deepspeed']}, {json.dumps(ds.get('ds_config'))}")
    for s, r in results.items():
        for side in ("strata", "pytorch", "deepspeed"):
            d = r.get(side, {})
            if "error" in d:
                print(f"  {s} {side}: error: {d['error']}")
            if "skipped" in d:
                print(f"  {s} {side}: skipped: {d['skipped']}")
    for line in results.get("largest", {}).get("strata", {}).get("placement", []):
        print(f"  largest: {line}")
    for s, r in results.items():
        e = r.get("estimate")
        if not e:
            continue
        if "error" in e:
            print(f"  {s} estimate: error: {e['error']}")
            continue
        print(f"  {s} vs strata estimate: device peak measured/estimated "
              f"{e['device_peak_ratio']:.3f} ({r['strata']['device_peak_bytes'] / 2**30:.2f} / "
              f"{e['device_peak_bytes'] / 2**30:.2f} GiB), step estimated/measured "
              f"{e['step_ratio']:.2f} ({e['step_s']:.3f} / {r['strata']['step_s']:.3f} s, "
              f"bound by {e['bottleneck']}; compute at {100 * e['gpu_efficiency']:.0f}% of "
              f"{args.peak_tflops:.0f} TFLOPS, calibrated on hbm)")
    if "hbm" in results and "mfu" in results["hbm"]["strata"]:
        st = results["hbm"]["strata"]
        print(f"  hbm: {st['tflops']:.1f} TFLOPS, MFU {100 * st['mfu']:.1f}% of "
              f"{args.peak_tflops:.0f}")
    out = {"benchmark": "gpu_train_bench", "model": args.model, "seq_len": args.seq_len,
           # A kernel choice in the environment (STRATA_ATTENTION=mma, exact) names the variant.
           "attention": os.environ.get("STRATA_ATTENTION", ""),
           "micro_batch": args.micro_batch, "bf16": args.bf16, "device": args.device,
           "steps": args.steps, "warmup": args.warmup, "results": results}
    text = json.dumps(out)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
