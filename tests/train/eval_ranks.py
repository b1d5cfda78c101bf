#!/usr/bin/env python3
"""Validation loss during training and `strata eval` agree, on any number of ranks.

Trains a tiny Llama for 4 steps on 2 ranks (ZeRO-3, parameters and optimizer states on NVMe)
with --eval-data --eval-every 2 --eval-sequences 16, saving every 2 steps. Then `strata eval`
of the step-4 checkpoint on the same 16 sequences, on 1, 2 and 4 ranks (ZeRO-3 on NVMe, and
stage 0): every result must equal the validation loss the training reported after step 4, to
1e-6 relative (the ranks' losses are summed in fp32).

usage: eval_ranks.py STRATA_BINARY MPIEXEC WORK_DIR
"""
import json
import os
import shutil
import sys

from ranks_util import run

TOLERANCE = 1e-6


def main():
    strata, mpiexec, work = sys.argv[1:4]
    shutil.rmtree(work, ignore_errors=True)
    nvme = os.path.join(work, "nvme")
    os.makedirs(nvme)
    data = os.path.join(work, "train.bin")
    held_out = os.path.join(work, "valid.bin")
    run([strata, "data", "synth", "--out", data, "--tokens", "40k", "--vocab", "256"])
    run([strata, "data", "synth", "--out", held_out, "--tokens", "10k", "--vocab", "256",
         "--seed", "9"])
    configs = {}
    for name, zero in (("zero3-nvme", {"stage": 3, "sub_group_size": 4096,
                                       "offload_param": {"device": "nvme", "nvme_path": nvme},
                                       "offload_optimizer": {"device": "nvme", "nvme_path": nvme}}),
                       ("stage0", {"stage": 0})):
        configs[name] = os.path.join(work, f"ds-{name}.json")
        with open(configs[name], "w") as f:
            json.dump({"train_micro_batch_size_per_gpu": 2,
                       "optimizer": {"type": "AdamW", "params": {"lr": 0.004}},
                       "zero_optimization": zero}, f)
    mpi = [mpiexec, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none"]
    metrics = os.path.join(work, "train.jsonl")
    ckpt = os.path.join(work, "ckpt")
    out = run(mpi + ["-np", "2", strata, "train", "--config", configs["zero3-nvme"], "--model",
                     "llama-tiny", "--data", data, "--seq-len", "32", "--steps", "4",
                     "--eval-data", held_out, "--eval-every", "2", "--eval-sequences", "16",
                     "--save", ckpt, "--save-every", "2", "--metrics", metrics])
    failures = []
    if "eval at step 2: loss" not in out or "eval at step 4: loss" not in out:
        failures.append("the training printed no 'eval at step N' lines")
    with open(metrics) as f:
        rows = {j["step"]: j for j in map(json.loads, filter(str.strip, f))}
    if "eval_loss" in rows[1] or "eval_loss" not in rows[2] or "eval_loss" not in rows[4]:
        failures.append(f"eval_loss in the metrics of steps {[s for s in rows if 'eval_loss' in rows[s]]}"
                        "; expected 2 and 4")
    expected = rows[4]["eval_loss"]
    print(f"validation loss after step 4 (2 ranks, during training): {expected:.8f}")
    if rows[2]["eval_loss"] == expected:
        failures.append("the validation loss did not change between steps 2 and 4")
    step4 = os.path.join(ckpt, "step-00000004")
    for name in ("zero3-nvme", "stage0"):
        for ranks in (1, 2, 4):
            result = os.path.join(work, f"eval-{name}-np{ranks}.json")
            launch = (mpi + ["-np", str(ranks)]) if ranks > 1 else []
            run(launch + [strata, "eval", "--model", step4, "--data", held_out, "--seq-len", "32",
                          "--sequences", "16", "--config", configs[name], "--json", result])
            with open(result) as f:
                got = json.load(f)
            rel = abs(got["loss"] - expected) / abs(expected)
            print(f"  strata eval, {name:<10} {ranks} rank(s): {got['loss']:.8f} over "
                  f"{got['sequences']} sequences (rel. diff {rel:.2e})")
            if got["sequences"] != 16 or rel > TOLERANCE:
                failures.append(f"{name} np{ranks}: loss {got['loss']} over {got['sequences']} "
                                f"sequences; expected {expected} over 16")
    if failures:
        sys.exit("FAILED:\n  " + "\n  ".join(failures))
    print("validation during training and strata eval on 1, 2 and 4 ranks: OK")


if __name__ == "__main__":
    main()
