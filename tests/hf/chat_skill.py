#!/usr/bin/env python3
"""chat_skill.py: teach a small chat model a skill with strata, then ask it through transformers.

Runs under the environment deploy/hf-venv.sh makes. tools/skill_task.py trains a byte-level BPE
tokenizer with `tokenizers` (ChatML special tokens and chat template) and writes a Llama-3-style
config (rope_scaling llama3, grouped-query attention) with conversations that teach two
deterministic skills: reversing a list of 3-6 digits and sorting it. 200 prompts per skill are
held out of the training files. Then:

  1. `strata data prepare` tokenizes both training files with the model's own tokenizer and chat
     template (only the assistant turns trained).
  2. (a) Full fine-tuning: `strata train` from random weights on the reverse conversations,
     AdamW, ZeRO-3 on 2 MPI ranks, parameters and optimizer states offloaded to NVMe (a
     directory), packed sequences of 256 tokens.
     transformers loads the checkpoint with its tokenizer; greedy generate from the chat template
     must answer at least 90% of the 200 held-out reverse prompts exactly.
  3. (b) LoRA: from (a)'s checkpoint, adapters (r 16, all linear layers) teach sorting. Before,
     (a)'s model sorts at most 20% of the held-out sort prompts (it reverses them); after, the
     checkpoint (base weights plus the PEFT adapter) loaded by transformers answers at least 90%,
     and so does `strata checkpoint merge-lora`'s merged directory (which keeps the chat template).

Usage: chat_skill.py --strata BIN --work DIR [--mpiexec MPIEXEC] [--python PY]. Exit 0 when every
check holds, 1 otherwise. It prints each phase's wall time; docs/testing.md records them.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SKILL = os.path.join(HERE, "..", "..", "tools", "skill_task.py")
FAILURES = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        FAILURES.append(what)


def run(cmd, log=None):
    start = time.time()
    with open(log, "w") if log else open(os.devnull, "w") as out:
        r = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, timeout=1800)
    if r.returncode != 0:
        tail = open(log).read()[-3000:] if log else ""
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}:\n{tail}")
    return time.time() - start


def ds_config(path, lr, weight_decay, zero, lora=None):
    config = {
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW",
                      "params": {"lr": lr, "betas": [0.9, 0.95], "weight_decay": weight_decay}},
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"warmup_num_steps": 20, "total_num_steps": "auto"}},
        "zero_optimization": zero,
    }
    if lora:
        config["strata"] = {"lora": lora}
    with open(path, "w") as f:
        json.dump(config, f, indent=1)
    return path


def accuracy(python, checkpoint, held, out_json, log):
    run([python, SKILL, "ask", checkpoint, held, "--json", out_json], log)
    print(open(log).read().rstrip(), flush=True)
    return json.load(open(out_json))["accuracy"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--strata", required=True)
    parser.add_argument("--work", required=True)
    parser.add_argument("--mpiexec", default="mpirun")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--full-steps", type=int, default=300)
    parser.add_argument("--lora-steps", type=int, default=700)
    args = parser.parse_args()

    work = os.path.abspath(args.work)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(os.path.join(work, "nvme"))
    mpi = [args.mpiexec, "-np", "2", "--oversubscribe", "--bind-to", "none"]
    if os.geteuid() == 0:
        mpi.append("--allow-run-as-root")
    times = {}

    times["make"] = run([args.python, SKILL, "make", work], os.path.join(work, "make.log"))
    model = os.path.join(work, "model")
    start = time.time()
    for task in ("reverse", "sort"):
        run([args.strata, "data", "prepare", "--model", model, "--python", args.python,
             "--input", os.path.join(work, f"train-{task}.jsonl"),
             "--out", os.path.join(work, f"{task}.stk")], os.path.join(work, f"prepare-{task}.log"))
    times["prepare"] = time.time() - start

    # (a) Full AdamW, ZeRO-3 on 2 ranks, parameters and optimizer states on NVMe.
    nvme = os.path.join(work, "nvme")
    full = ds_config(os.path.join(work, "full.json"), 2e-3, 0.01, {
        "stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme},
        "offload_optimizer": {"device": "nvme", "nvme_path": nvme}, "sub_group_size": 1000000})
    ck_full = os.path.join(work, "ck-full")
    times["train_full"] = run(mpi + [
        args.strata, "train", "--config", full, "--model", model,
        "--data", os.path.join(work, "reverse.stk"), "--seq-len", "256",
        "--steps", str(args.full_steps), "--device", "cpu", "--save", ck_full],
        os.path.join(work, "train-full.log"))
    log = open(os.path.join(work, "train-full.log")).read()
    check("parameters on nvme, optimizer on nvme" in log and "ZeRO stage 3" in log
          and "2 rank(s)" in log, "(a) ran ZeRO-3 on 2 ranks with parameters and optimizer on NVMe")
    start = time.time()
    acc_full = accuracy(args.python, os.path.join(ck_full, "latest"),
                        os.path.join(work, "held-reverse.jsonl"),
                        os.path.join(work, "ask-full.json"), os.path.join(work, "ask-full.log"))
    acc_before = accuracy(args.python, os.path.join(ck_full, "latest"),
                          os.path.join(work, "held-sort.jsonl"),
                          os.path.join(work, "ask-before.json"),
                          os.path.join(work, "ask-before.log"))
    times["ask_full"] = time.time() - start
    check(acc_full >= 0.9, f"(a) full fine-tuning: {acc_full:.1%} of 200 held-out reverse "
          "prompts answered exactly (>= 90%)")
    check(acc_before <= 0.2, f"(a)'s model sorts {acc_before:.1%} of the held-out sort prompts "
          "before LoRA (<= 20%)")

    # (b) LoRA from (a)'s checkpoint, teaching the second skill.
    lora = ds_config(os.path.join(work, "lora.json"), 4e-3, 0.0,
                     {"stage": 3, "offload_param": {"device": "cpu"}},
                     {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"})
    ck_lora = os.path.join(work, "ck-lora")
    times["train_lora"] = run(mpi + [
        args.strata, "train", "--config", lora, "--model", os.path.join(ck_full, "latest"),
        "--data", os.path.join(work, "sort.stk"), "--seq-len", "256",
        "--steps", str(args.lora_steps), "--device", "cpu", "--save", ck_lora],
        os.path.join(work, "train-lora.log"))
    latest = os.path.join(ck_lora, "latest")
    check(os.path.exists(os.path.join(latest, "adapter_config.json"))
          and os.path.exists(os.path.join(latest, "adapter_model.safetensors")),
          "(b) the LoRA checkpoint holds a PEFT adapter")
    start = time.time()
    acc_lora = accuracy(args.python, latest, os.path.join(work, "held-sort.jsonl"),
                        os.path.join(work, "ask-lora.json"), os.path.join(work, "ask-lora.log"))
    times["ask_lora"] = time.time() - start
    check(acc_lora >= 0.9, f"(b) LoRA: {acc_lora:.1%} of 200 held-out sort prompts answered "
          "exactly (>= 90%)")

    # The adapter folded into the weights: a plain model directory with its tokenizer and chat
    # template, answering as the adapter did.
    merged = os.path.join(work, "merged")
    run([args.strata, "checkpoint", "merge-lora", "--base", latest, "--adapter", latest,
         "--out", merged], os.path.join(work, "merge.log"))
    check(os.path.exists(os.path.join(merged, "chat_template.jinja"))
          and not os.path.exists(os.path.join(merged, "adapter_config.json")),
          "merge-lora wrote a plain model directory with the chat template")
    acc_merged = accuracy(args.python, merged, os.path.join(work, "held-sort.jsonl"),
                          os.path.join(work, "ask-merged.json"),
                          os.path.join(work, "ask-merged.log"))
    check(acc_merged >= 0.9, f"(b) merged: {acc_merged:.1%} of 200 held-out sort prompts "
          "answered exactly (>= 90%)")

    summary = {"accuracy_full_reverse": acc_full, "accuracy_merged_sort": acc_merged, "accuracy_sort_before_lora": acc_before,
               "accuracy_lora_sort": acc_lora, "full_steps": args.full_steps,
               "lora_steps": args.lora_steps, "seconds": {k: round(v, 1) for k, v in times.items()}}
    print(json.dumps(summary))
    print("times: " + ", ".join(f"{k} {v:.0f} s" for k, v in times.items()))
    if FAILURES:
        print(f"chat_skill: {len(FAILURES)} check(s) failed")
        return 1
    print("chat_skill: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
