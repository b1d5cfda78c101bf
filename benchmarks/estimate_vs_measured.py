#!/usr/bin/env python3
"""The time model of `strata estimate` against measured `strata train` steps (issue 20, section 3).

For several placements on the CPU device (stages 0-3, optimizer on the device, the CPU and NVMe,
parameters on NVMe, 1 and 2 ranks), runs a few training steps, takes the median step time of the
steps after the first two, and compares it with the estimate's step time for the same config.

Rates the estimate needs are measured on this machine in the same run, never quoted, by
`strata estimate --measure` (CPU AdamW with the engine's kernel on one thread, as the CPU device
gives each rank's optimizer; NVMe with nvme-bench's engine in the directory the runs use, and the
share of compute its transfers take while they run; OpenBLAS sgemm for compute). Three estimates
per case:
  - calibrated (the target): compute from a calibration run (stage 0, the same model, precision
    and rank count), whose measured compute time per step fixes the effective TFLOPS, as a GPU
    run's would fix --gpu-efficiency; collectives (2 ranks over MPI on one host) from a stage-0
    run on 2 ranks, whose exposed communication is one all-reduce of the fp32 gradients. The
    calibration runs' own ratios are near 1 by construction and are reported as such.
  - the same with NVMe time all added to the step (--io-cpu-share 1, the model before the share
    was measured), for comparison in the same run.
  - measured rates only: compute at the sgemm rate (the CPU ops' other work makes the model's
    effective rate lower, so this one is optimistic), for information.

Prints one JSON object (--json) or a table; the target is |estimate / measured - 1| <= 25%.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

def llama(hidden, inter, layers, heads, kv, vocab=4096):
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
            "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv,
            "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "tie_word_embeddings": False, "hidden_act": "silu"}


# Two regimes: compute-bound (16M parameters, 2 x 2 x 256 tokens a step), and offload-heavy
# (67M parameters, 1 x 32 tokens a step: the optimizer, its NVMe traffic and the parameter
# fetches are 35-45% of the NVMe cases' steps).
REGIMES = [
    {"name": "compute-bound", "model": llama(512, 1408, 4, 8, 4), "seq": 256, "mb": 2, "gas": 2},
    {"name": "offload-heavy", "model": llama(1024, 2816, 5, 16, 4), "seq": 32, "mb": 1, "gas": 1},
]


def run(cmd, env=None, timeout=1800):
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if r.returncode != 0:
        sys.exit(f"estimate_vs_measured: {' '.join(cmd)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r.stdout


def ds_config(zero, nvme, regime, clip=False, strata=None):
    z = dict(zero)
    for key in ("offload_param", "offload_optimizer"):
        if key in z and z[key].get("device") == "nvme":
            z[key] = dict(z[key], nvme_path=nvme)
    c = {"train_micro_batch_size_per_gpu": regime["mb"], "gradient_accumulation_steps": regime["gas"],
         "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
         "zero_optimization": z}
    if clip:
        c["gradient_clipping"] = 1.0
    if strata:
        c["strata"] = strata
    return c


CASES = [
    # name, ranks, zero_optimization, clipping[, the config's "strata" section]
    ("stage 0 (compute calibration)", 1, {"stage": 0}, False),
    ("stage 1, optimizer on the CPU", 1, {"stage": 1, "offload_optimizer": {"device": "cpu"}}, False),
    ("stage 2, optimizer on the CPU", 1, {"stage": 2, "offload_optimizer": {"device": "cpu"}}, False),
    ("stage 2, CPU optimizer, clipping", 1, {"stage": 2, "offload_optimizer": {"device": "cpu"}}, True),
    ("stage 3, all on the device", 1, {"stage": 3}, False),
    ("stage 3, optimizer on NVMe", 1, {"stage": 3, "offload_optimizer": {"device": "nvme"}}, False),
    ("stage 3, parameters and optimizer on NVMe", 1,
     {"stage": 3, "offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "nvme"}}, False),
    ("stage 3, half the optimizer on NVMe", 1,
     {"stage": 3, "offload_optimizer": {"device": "nvme", "ratio": 0.5}}, False),
    ("stage 0, 2 ranks (collective calibration)", 2, {"stage": 0}, False),
    ("stage 2, 2 ranks, optimizer on the CPU", 2, {"stage": 2, "offload_optimizer": {"device": "cpu"}}, False),
    ("stage 3, 2 ranks, optimizer on NVMe", 2, {"stage": 3, "offload_optimizer": {"device": "nvme"}}, False),
    # Frozen units skip their weight-gradient GEMMs; LoRA freezes every base unit.
    ("stage 2, CPU optimizer, half the layers frozen", 1,
     {"stage": 2, "offload_optimizer": {"device": "cpu"}}, False,
     {"freeze": ["model.embed_tokens.*", "model.layers.[01].*"]}),
    ("stage 3, LoRA r 16 all-linear, parameters on NVMe", 1,
     {"stage": 3, "offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "cpu"}}, False,
     {"lora": {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}}),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--strata", required=True)
    ap.add_argument("--mpirun", default=shutil.which("mpirun") or "mpirun")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--dir", help="work directory (default: a temporary one, removed)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--only", default=None,
                    help="run the calibration cases and those whose name holds one of these "
                         "comma-separated texts")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: the compute-bound regime, 3 single-rank cases, 4 steps")
    a = ap.parse_args()
    steps = 4 if a.quick else a.steps
    work = a.dir or tempfile.mkdtemp(prefix="strata-evm-")
    os.makedirs(work, exist_ok=True)
    data = os.path.join(work, "tokens.bin")
    run([a.strata, "data", "synth", "--out", data, "--tokens", "400k", "--vocab", "4096"])
    nvme = os.path.join(work, "nvme")
    os.makedirs(nvme, exist_ok=True)

    # Rates, measured here and now.
    probe = json.loads(run([a.strata, "estimate", "--model", "llama-tiny", "--device", "cpu",
                            "--measure", "--nvme-path", nvme, "--json"]))
    hw = probe["hardware"]
    rates = {"cpu_adam": hw["cpu_adam_params_per_s"], "nvme_read": hw["nvme_read_bps"],
             "nvme_write": hw["nvme_write_bps"], "sgemm_tflops": hw["gpu_tflops"],
             "io_cpu_share": hw["io_cpu_share"]}

    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    rows = []
    tflops_by = {}
    bus_by = {}
    quick_cases = ("stage 0 (compute calibration)", "stage 2, optimizer on the CPU",
                   "stage 3, parameters and optimizer on NVMe")
    for regime in REGIMES[:1] if a.quick else REGIMES:
        model = os.path.join(work, "model-" + regime["name"])
        os.makedirs(model, exist_ok=True)
        with open(os.path.join(model, "config.json"), "w") as f:
            json.dump(regime["model"], f)
        for name, ranks, zero, clip, *strata in CASES:
            if a.quick and name not in quick_cases:
                continue
            if a.only and not any(o in name for o in a.only.split(",")) and "calibration" not in name:
                continue
            cfg = os.path.join(work, "ds.json")
            with open(cfg, "w") as f:
                json.dump(ds_config(zero, nvme, regime, clip, strata[0] if strata else None), f)
            metrics = os.path.join(work, "metrics.jsonl")
            if os.path.exists(metrics):
                os.remove(metrics)
            cmd = [a.strata, "train", "--model", model, "--config", cfg, "--data", data, "--device", "cpu",
                   "--seq-len", str(regime["seq"]), "--steps", str(steps), "--metrics", metrics]
            if ranks > 1:
                cmd = [a.mpirun, "-np", str(ranks), "--bind-to", "none"] + cmd
            if "calibration" in name:
                run(cmd, env=env)  # a warm-up: the first run after the rates' benchmarks is slower
                os.remove(metrics)
            run(cmd, env=env)
            with open(metrics) as f:
                m = [json.loads(line) for line in f if line.strip()][2:]
            measured = statistics.median(r["step_s"] for r in m)
            compute = statistics.median(r["compute_s"] for r in m)
            comm = statistics.median(r["exposed_comm_s"] for r in m)

            def estimate(extra, io_cpu_share=rates["io_cpu_share"]):
                cmd = [a.strata, "estimate", "--model", model, "--config", cfg, "--device", "cpu",
                       "--seq-len", str(regime["seq"]), "--gpus", str(ranks), "--json",
                       "--cpu-adam", f"{rates['cpu_adam'] * ranks:.6g}",
                       "--nvme-read", f"{rates['nvme_read']:.6g}", "--nvme-write", f"{rates['nvme_write']:.6g}",
                       "--io-cpu-share", f"{io_cpu_share:.6g}", "--gpu-efficiency", "1"] + extra
                return json.loads(run(cmd))["time"]

            key = (regime["name"], ranks)
            if key not in tflops_by:
                # Calibrate (per regime and rank count: ranks share the cores): the compute time the
                # model predicts at 1 TFLOPS, scaled to the measured.
                t = estimate(["--gpu-tflops", "1"])
                tflops_by[key] = t["compute_s"] / compute
            extra = ["--gpu-tflops", f"{tflops_by[key]:.6g}"]
            if ranks > 1:
                if regime["name"] not in bus_by:
                    t = estimate(extra + ["--nvlink", "1e9"])
                    bus_by[regime["name"]] = 1e9 * t["collective_s"] / max(comm, 1e-6)
                extra += ["--nvlink", f"{bus_by[regime['name']]:.6g}"]
            t = estimate(extra)
            # The same with every NVMe second added to the step (io_cpu_share 1), for comparison.
            additive = estimate(extra, 1.0)
            raw = estimate(["--gpu-tflops", f"{rates['sgemm_tflops'] / ranks:.6g}"] +
                           (["--nvlink", f"{bus_by[regime['name']]:.6g}"] if ranks > 1 else []))
            calib = "calibration" in name
            rows.append({"regime": regime["name"], "case": name, "ranks": ranks,
                         "measured_step_s": measured,
                         "estimated_step_s": t["step_s"], "ratio": t["step_s"] / measured,
                         "calibration": calib, "bound_by": t["bound_by"], "bottleneck": t["bottleneck"],
                         "measured_compute_s": compute, "estimated_compute_s": t["compute_s"],
                         "estimated_optimizer_s": t["optimizer_s"] + t.get("device_optimizer_s", 0.0),
                         "estimated_nvme_s": t["nvme_read_s"] + t["nvme_write_s"],
                         "estimated_optimizer_exposed_s": t["exposed_optimizer_s"],
                         "additive_step_s": additive["step_s"],
                         "additive_ratio": additive["step_s"] / measured,
                         "measured_rates_step_s": raw["step_s"],
                         "measured_rates_ratio": raw["step_s"] / measured,
                         "within_25pct": abs(t["step_s"] / measured - 1) <= 0.25})
    checked = [r for r in rows if not r["calibration"]]
    out = {"benchmark": "estimate_vs_measured", "regimes": REGIMES, "steps": steps,
           "rates": dict(rates,
                         effective_tflops={f"{k[0]}, {k[1]} rank(s)": v for k, v in tflops_by.items()},
                         collective_bps=bus_by),
           "cpus": os.cpu_count(), "results": rows,
           "within_25pct": sum(r["within_25pct"] for r in checked), "checked": len(checked),
           "additive_within_25pct": sum(abs(r["additive_ratio"] - 1) <= 0.25 for r in checked)}
    if a.json:
        print(json.dumps(out))
    else:
        print(f"rates: CPU Adam {rates['cpu_adam'] / 1e9:.2f} G/s per thread, sgemm "
              f"{rates['sgemm_tflops'] * 1e3:.0f} GFLOPS, NVMe read "
              f"{rates['nvme_read'] / 1e9:.2f} GB/s, write {rates['nvme_write'] / 1e9:.2f} GB/s, "
              f"NVMe's CPU share {rates['io_cpu_share']:.2f}; "
              "compute (calibrated) " +
              ", ".join(f"{k[0]} {k[1]} rank(s) {v:.3f} TFLOPS" for k, v in tflops_by.items()) +
              "; collectives " + ", ".join(f"{k} {v / 1e9:.2f} GB/s" for k, v in bus_by.items()))
        print(f"{'regime':<14} {'case':<44} {'ranks':>5} {'measured s':>11} {'estimate s':>11} "
              f"{'ratio':>6} {'add.':>6} {'raw':>6}  bottleneck")
        for r in rows:
            print(f"{r['regime']:<14} {r['case']:<44} {r['ranks']:>5} {r['measured_step_s']:>11.3f} "
                  f"{r['estimated_step_s']:>11.3f} {r['ratio']:>6.2f} {r['additive_ratio']:>6.2f} "
                  f"{r['measured_rates_ratio']:>6.2f}"
                  f"  {r['bottleneck']}"
                  f"{'' if r['calibration'] else ('' if r['within_25pct'] else '  (outside 25%)')}")
        print(f"{out['within_25pct']} of {out['checked']} checked cases within 25% "
              f"({out['additive_within_25pct']} with NVMe time all added; ratio: calibrated compute "
              "and the measured CPU share of NVMe time; add.: that share 1; raw: measured rates "
              "only, sgemm compute)")
    if not a.dir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
