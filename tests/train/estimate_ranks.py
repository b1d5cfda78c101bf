#!/usr/bin/env python3
"""`strata estimate` against `strata train` on several ranks (issue 20: 1 to 4 ranks, within 5%).

For 2 and 4 ranks of the CPU device and several placements (stages 1-3, fp32, bf16 and fp16,
untied and tied embeddings, the optimizer on the device, the CPU and NVMe, parameters on NVMe),
trains 2 steps under mpirun with --metrics and compares rank 0's device peak
(device_peak_bytes) with the estimate's device peak for the same config and rank count; the NVMe
swap files' sizes are in the estimate and checked by the single-rank test. Prints one line per
case and fails when any ratio is outside [0.95, 1.05].

usage: estimate_ranks.py STRATA_BINARY MPIEXEC WORK_DIR
"""
import json
import os
import shutil
import subprocess
import sys

TOLERANCE = 0.05


def run(cmd):
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    if r.returncode != 0:
        print("+", " ".join(cmd))
        print(r.stdout)
        sys.exit(f"command failed with exit code {r.returncode}")
    return r.stdout


def model(path, tied):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                   "vocab_size": 2048, "hidden_size": 256, "intermediate_size": 704,
                   "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                   "tie_word_embeddings": tied, "hidden_act": "silu"}, f)
    return path


def main():
    strata, mpiexec, work = sys.argv[1:4]
    shutil.rmtree(work, ignore_errors=True)
    nvme = os.path.join(work, "nvme")
    os.makedirs(nvme)
    data = os.path.join(work, "tokens.bin")
    run([strata, "data", "synth", "--out", data, "--tokens", "100k", "--vocab", "2048"])
    untied = model(os.path.join(work, "untied"), False)
    tied = model(os.path.join(work, "tied"), True)
    cases = [
        # name, model, precision, zero_optimization
        ("stage 1 bf16, optimizer on the CPU", untied, "bf16",
         {"stage": 1, "offload_optimizer": {"device": "cpu"}}),
        ("stage 2 fp32, optimizer on the device", untied, None, {"stage": 2}),
        ("stage 2 fp16, tied, optimizer on the CPU", tied, "fp16",
         {"stage": 2, "offload_optimizer": {"device": "cpu"}}),
        ("stage 3 bf16, everything on the device", untied, "bf16", {"stage": 3}),
        ("stage 3 bf16, tied, everything on the device", tied, "bf16", {"stage": 3}),
        ("stage 3 bf16, parameters and optimizer on NVMe", untied, "bf16",
         {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme},
          "offload_optimizer": {"device": "nvme", "nvme_path": nvme}}),
    ]
    mpi = [mpiexec, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none"]
    worst = 0.0
    failed = []
    for ranks in (2, 4):
        for name, m, precision, zero in cases:
            cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                   "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                   "zero_optimization": zero}
            if precision:
                cfg[precision] = {"enabled": True}
            path = os.path.join(work, "ds.json")
            with open(path, "w") as f:
                json.dump(cfg, f)
            est = json.loads(run([strata, "estimate", "--model", m, "--config", path, "--device",
                                  "cpu", "--ranks", str(ranks), "--seq-len", "128", "--json"]))
            metrics = os.path.join(work, "metrics.jsonl")
            if os.path.exists(metrics):
                os.remove(metrics)
            run(mpi + ["-np", str(ranks), strata, "train", "--model", m, "--config", path,
                       "--data", data, "--seq-len", "128", "--steps", "2", "--device", "cpu",
                       "--metrics", metrics])
            with open(metrics) as f:
                peak = max(json.loads(line)["device_peak_bytes"] for line in f if line.strip())
            ratio = peak / est["device"]["peak_bytes"]
            worst = max(worst, abs(ratio - 1))
            ok = abs(ratio - 1) <= TOLERANCE
            print(f"{ranks} ranks  {name:<50} measured {peak:>11} B  estimated "
                  f"{est['device']['peak_bytes']:>11} B  {ratio:.4f}{'' if ok else '  OUTSIDE 5%'}",
                  flush=True)
            if not ok:
                failed.append(f"{ranks} ranks, {name}: {ratio:.4f}")
    print(f"worst |measured / estimated - 1| = {worst:.4f}")
    if failed:
        sys.exit("outside 5%: " + "; ".join(failed))


if __name__ == "__main__":
    main()
