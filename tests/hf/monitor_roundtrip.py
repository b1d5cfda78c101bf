#!/usr/bin/env python3
"""monitor_roundtrip.py: what `strata train` writes for DeepSpeed's "tensorboard" and
"csv_monitor" sections, read back by TensorBoard's own reader (tensorboard from PyPI, in the
environment deploy/hf-venv.sh makes) and by Python's csv module, against the run's --metrics file.

Checks: TensorBoard's EventAccumulator loads the event file and finds every tag; the train loss
and learning rate series have one value per step, at steps counted in samples (DeepSpeed's
convention), equal to the metrics file's values rounded to float32; Strata's own series count
optimizer steps; each CSV file has DeepSpeed's layout (header "step,<name>") and the exact values.

Usage: monitor_roundtrip.py --strata BIN --work DIR. Exit 0 when every check holds.
"""
import argparse
import csv
import glob
import json
import os
import shutil
import struct
import subprocess
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def f32(x):
    return struct.unpack("f", struct.pack("f", x))[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--strata", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    data = os.path.join(args.work, "tokens.bin")
    subprocess.run([args.strata, "data", "synth", "--out", data, "--tokens", "20k", "--vocab",
                    "256"], check=True, capture_output=True)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3,
                                                        "warmup_max_lr": 3e-3}},
           "zero_optimization": {"stage": 3},
           "tensorboard": {"enabled": True, "output_path": os.path.join(args.work, "tb"),
                           "job_name": "tiny"},
           "csv_monitor": {"enabled": True, "output_path": os.path.join(args.work, "csv"),
                           "job_name": "tiny"}}
    config = os.path.join(args.work, "ds.json")
    with open(config, "w") as f:
        json.dump(cfg, f)
    metrics = os.path.join(args.work, "metrics.jsonl")
    steps = 6
    r = subprocess.run([args.strata, "train", "--config", config, "--model", "llama-tiny",
                        "--data", data, "--seq-len", "32", "--steps", str(steps), "--device",
                        "cpu", "--metrics", metrics], capture_output=True, text=True)
    if r.returncode != 0:
        print(r.stdout, r.stderr)
        return 1
    rows = [json.loads(line) for line in open(metrics)]
    failures = []

    def check(ok, what):
        print(("ok    " if ok else "FAIL  ") + what)
        if not ok:
            failures.append(what)

    check("monitor: " + os.path.join(args.work, "tb", "tiny") in r.stdout,
          "strata train names the event file it writes")
    files = glob.glob(os.path.join(args.work, "tb", "tiny", "events.out.tfevents.*"))
    check(len(files) == 1, f"one event file ({files})")
    ea = EventAccumulator(files[0])
    ea.Reload()
    tags = set(ea.Tags()["scalars"])
    want_tags = {"Train/Samples/train_loss", "Train/Samples/lr", "Train/Strata/tokens_per_s",
                 "Train/Strata/step_s", "Train/Strata/compute_s", "Train/Strata/exposed_comm_s",
                 "Train/Strata/exposed_io_s", "Train/Strata/exposed_optimizer_s",
                 "Train/Strata/grad_norm", "Train/Strata/device_peak_bytes"}
    check(want_tags <= tags, f"TensorBoard finds the tags (missing {want_tags - tags})")
    global_batch = 4  # 2 per rank x 2 accumulation x 1 rank
    for tag, key in (("Train/Samples/train_loss", "loss"), ("Train/Samples/lr", "lr")):
        got = [(e.step, e.value) for e in ea.Scalars(tag)]
        want = [(row["step"] * global_batch, f32(row[key])) for row in rows]
        check(got == want, f"{tag}: {got} == {want} (steps in samples, float32 values)")
    got = [(e.step, e.value) for e in ea.Scalars("Train/Strata/grad_norm")]
    want = [(row["step"], f32(row["grad_norm"])) for row in rows]
    check(got == want, f"Train/Strata/grad_norm per optimizer step: {got} == {want}")

    path = os.path.join(args.work, "csv", "tiny", "Train_Samples_train_loss.csv")
    with open(path) as f:
        table = list(csv.reader(f))
    check(table[0] == ["step", "train_loss"], f"CSV header {table[0]}")
    got = [(int(s), float(v)) for s, v in table[1:]]
    want = [(row["step"] * global_batch, row["loss"]) for row in rows]
    check(got == want, f"CSV train loss {got} == {want} (exact)")
    n_csv = len(glob.glob(os.path.join(args.work, "csv", "tiny", "*.csv")))
    check(n_csv >= len(want_tags), f"one CSV file per tag ({n_csv})")
    print(f"monitor_roundtrip: {len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
