#!/usr/bin/env python3
"""Checkpoints saved on N ranks resume on M ranks.

Trains a tiny Llama (ZeRO-3, parameters and optimizer states on NVMe, fp32, clipping, a warm-up
cosine schedule) for 6 steps on 2 ranks, saving every 3 steps; then resumes the step-3 checkpoint
on 2 ranks (the losses of steps 4-6 must be bit-identical), on 4 ranks and on 1 process (the
global batch is the same, only the order of the gradient sums changes: relative difference at
most 1e-5 per step).

usage: resume_ranks.py STRATA_BINARY MPIEXEC WORK_DIR
"""
import os
import shutil
import sys

from ranks_util import losses, run, write_nvme_config

TOLERANCE = 1e-5


def main():
    strata, mpiexec, work = sys.argv[1:4]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(os.path.join(work, "nvme"))
    data = os.path.join(work, "tokens.bin")
    run([strata, "data", "synth", "--out", data, "--tokens", "60k", "--vocab", "256"])
    config = os.path.join(work, "ds.json")
    write_nvme_config(config, os.path.join(work, "nvme"))
    mpi = [mpiexec, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none"]
    train = ["train", "--config", config, "--data", data, "--steps", "6"]
    ckpt = os.path.join(work, "ckpt")
    run(mpi + ["-np", "2", strata] + train + ["--model", "llama-tiny", "--seq-len", "32",
                                              "--save", ckpt, "--save-every", "3", "--metrics",
                                              os.path.join(work, "full.jsonl")])
    full = losses(os.path.join(work, "full.jsonl"))
    step3 = os.path.join(ckpt, "step-00000003")
    failures = []
    print(f"{'resumed on':>10} {'step':>4} {'loss':>12} {'uninterrupted':>14} {'rel. diff':>10}")
    for ranks in (2, 4, 1):
        metrics = os.path.join(work, f"resumed_np{ranks}.jsonl")
        launch = (mpi + ["-np", str(ranks)]) if ranks > 1 else []
        out = run(launch + [strata] + train + ["--resume", step3, "--metrics", metrics])
        if f"saved on 2 rank(s), now {ranks}" not in out:
            failures.append(f"np{ranks}: no 'resumed ... saved on 2 rank(s), now {ranks}' line")
        got = losses(metrics)
        if sorted(got) != [4, 5, 6]:
            failures.append(f"np{ranks}: steps {sorted(got)}; expected 4, 5, 6")
            continue
        for step in (4, 5, 6):
            rel = abs(got[step] - full[step]) / abs(full[step])
            print(f"{ranks:>10} {step:>4} {got[step]:>12.8f} {full[step]:>14.8f} {rel:>10.2e}")
            if ranks == 2 and got[step] != full[step]:
                failures.append(f"np2 step {step}: {got[step]!r} != {full[step]!r} (same ranks: "
                                "must be bit-identical)")
            if rel > TOLERANCE:
                failures.append(f"np{ranks} step {step}: relative difference {rel:.2e} > {TOLERANCE}")
    if failures:
        sys.exit("FAILED:\n  " + "\n  ".join(failures))
    print("resume across rank counts: OK")


if __name__ == "__main__":
    main()
