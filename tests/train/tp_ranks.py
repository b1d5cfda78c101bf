#!/usr/bin/env python3
"""strata train with tensor parallelism: checkpoints move between TP and data parallelism.

On 4 ranks (mpirun), a tiny Llama (2 KV heads) trains for 6 steps with ZeRO-3, parameters and
optimizer states on NVMe, gradient clipping and a warm-up cosine schedule:

  A  tensor_parallel.autotp_size 1 (data parallelism 4), saving at steps 3 and 6;
  B  autotp_size 2 (TP 2 x DP 2), the same;
  C  B's step 3 resumed at TP 1 x DP 4;
  D  A's step 3 resumed at TP 2 x DP 2;
  E  B's step 3 resumed at TP 4 (the KV heads replicated on 2 ranks each), saving at step 6.

Every loss must match A's within LOSS_RTOL (the same global batch; only the order of sums
differs), and the checkpoints B and E save at step 6 (each rank writing its rows or columns into
the whole tensors) must hold A's weights and optimizer states within TENSOR_RTOL of each
tensor's largest value. transformers loads B's step 6, and its loss on 8 windows matches
`strata eval` of the same directory and A's.

usage: tp_ranks.py STRATA_BINARY MPIEXEC WORK_DIR   (run with the hf venv's python)
"""
import json
import os
import shutil
import sys

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM

from ranks_util import losses, run, write_nvme_config

LOSS_RTOL = 1e-4
TENSOR_RTOL = 1e-4
SEQ = 32


def tensors(step_dir):
    out = {}
    for name in ("model.safetensors", "optimizer.safetensors"):
        out.update(load_file(os.path.join(step_dir, name)))
    return out


def hf_loss(model_dir, rows):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=rows[:, :-1]).logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1)).item()


def main():
    strata, mpiexec, work = sys.argv[1:4]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(os.path.join(work, "nvme"))
    data = os.path.join(work, "tokens.bin")
    run([strata, "data", "synth", "--out", data, "--tokens", "60k", "--vocab", "256"])
    configs = {}
    for tp in (1, 2, 4):
        configs[tp] = os.path.join(work, f"tp{tp}.json")
        write_nvme_config(configs[tp], os.path.join(work, "nvme"), tp)
    mpi = [mpiexec, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", "4"]
    failures = []

    def train(name, tp, extra):
        metrics = os.path.join(work, f"{name}.jsonl")
        out = run(mpi + [strata, "train", "--config", configs[tp], "--data", data, "--steps", "6",
                         "--metrics", metrics] + extra)
        if tp > 1 and f"tensor parallelism {tp} x data parallelism {4 // tp}" not in out:
            failures.append(f"{name}: the banner does not name TP {tp} x DP {4 // tp}")
        return losses(metrics), out

    def save(name):
        return ["--save", os.path.join(work, name), "--save-every", "3"]

    fresh = ["--model", "llama-tiny", "--seq-len", str(SEQ)]
    a, _ = train("A", 1, fresh + save("A"))
    b, _ = train("B", 2, fresh + save("B"))
    c, out_c = train("C", 1, ["--resume", os.path.join(work, "B", "step-00000003")])
    d, _ = train("D", 2, ["--resume", os.path.join(work, "A", "step-00000003")])
    e, _ = train("E", 4, ["--resume", os.path.join(work, "B", "step-00000003")] + save("E"))
    if "saved on 4 rank(s) with tensor parallelism 2, now 4)" not in out_c:
        failures.append("C: the resume line does not say the checkpoint was saved with TP 2")

    print(f"{'run':>4} {'step':>4} {'loss':>12} {'A (TP 1)':>12} {'rel. diff':>10}")
    for name, got, steps in (("B", b, range(1, 7)), ("C", c, range(4, 7)),
                             ("D", d, range(4, 7)), ("E", e, range(4, 7))):
        if sorted(got) != list(steps):
            failures.append(f"{name}: steps {sorted(got)}; expected {list(steps)}")
            continue
        for step in steps:
            rel = abs(got[step] - a[step]) / abs(a[step])
            print(f"{name:>4} {step:>4} {got[step]:>12.8f} {a[step]:>12.8f} {rel:>10.2e}")
            if rel > LOSS_RTOL:
                failures.append(f"{name} step {step}: loss {got[step]} against A's {a[step]} "
                                f"(relative difference {rel:.2e} > {LOSS_RTOL})")

    # The whole tensors B (TP 2) and E (TP 4) wrote against A's.
    want = tensors(os.path.join(work, "A", "step-00000006"))
    for name in ("B", "E"):
        got = tensors(os.path.join(work, name, "step-00000006"))
        if sorted(got) != sorted(want):
            failures.append(f"{name}: tensors {sorted(set(got) ^ set(want))} differ in name")
            continue
        worst = (0.0, "")
        for key, w in want.items():
            g = got[key]
            if g.shape != w.shape:
                failures.append(f"{name}: {key} has shape {g.shape}, A's {w.shape}")
                continue
            scale = max(float(np.abs(w).max()), 1e-6)
            rel = float(np.abs(g.astype(np.float64) - w.astype(np.float64)).max()) / scale
            worst = max(worst, (rel, key))
            if rel > TENSOR_RTOL:
                failures.append(f"{name}: {key} differs from A's by {rel:.2e} of its largest value")
        print(f"{name}: {len(want)} tensors at step 6, largest difference {worst[0]:.2e} ({worst[1]})")

    # transformers loads the TP checkpoint; its loss is strata eval's and A's.
    tokens = np.fromfile(data, dtype="<u2")
    rows = torch.from_numpy(np.stack([tokens[w * SEQ:w * SEQ + SEQ + 1]
                                      for w in range(8)]).astype(np.int64))
    theirs_b = hf_loss(os.path.join(work, "B", "step-00000006"), rows)
    theirs_a = hf_loss(os.path.join(work, "A", "step-00000006"), rows)
    result = os.path.join(work, "eval.json")
    run([strata, "eval", "--model", os.path.join(work, "B", "step-00000006"), "--data", data,
         "--seq-len", str(SEQ), "--sequences", "8", "--micro-batch", "4", "--json", result])
    with open(result) as f:
        ours = json.load(f)["loss"]
    print(f"transformers on B's step 6: {theirs_b:.8f}; strata eval: {ours:.8f}; "
          f"transformers on A's: {theirs_a:.8f}")
    for what, x, y in (("strata eval", ours, theirs_b), ("A's checkpoint", theirs_a, theirs_b)):
        if abs(x - y) / abs(y) > LOSS_RTOL:
            failures.append(f"transformers' loss on B's step 6 ({theirs_b}) against {what} ({x})")
    if failures:
        sys.exit("FAILED:\n  " + "\n  ".join(failures))
    print("tensor parallelism under strata train, across TP degrees: OK")


if __name__ == "__main__":
    main()
