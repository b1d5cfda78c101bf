#!/usr/bin/env python3
"""hf_families.py: each model family Strata trains, against transformers' own implementation.

Runs under the environment deploy/hf-venv.sh makes (transformers 5, torch 2 from PyPI). For each
case below, transformers builds a small random model of the family and writes it with
`save_pretrained` (fp32; and bf16 for the loss check). Weights are drawn with std 0.1 (not the
default 0.02, under which attention is nearly uniform and a wrong RoPE or norm hides), and
biases and q/k norm weights are set to random values (transformers initialises them to 0 and 1,
which would make their forward a no-op). Then:

  1. Loss and every parameter's gradient of one batch (4 sequences of 64 tokens, longer than the
     RoPE scalings' original_max_position_embeddings of 16, so that the scaling matters):
     Strata takes one AdamW step with betas (0, 0), whose saved first moment (exp_avg in
     optimizer.safetensors) is the gradient exactly; transformers computes loss.backward().
     Tolerances (fp32 both sides; only the order of summation differs): loss relative 1e-5,
     each gradient tensor relative 1e-4 in norm (||g_strata - g_hf|| / ||g_hf||).
  2. Twenty AdamW steps (lr 1e-3, weight decay 0.01) on the same 20 batches: Strata's losses
     against transformers + torch.optim.AdamW's, step by step, relative 1e-4, and the final
     weights relative 1e-3 in norm.
  3. The checkpoint Strata saved loads with AutoModelForCausalLM as the family's class, with no
     missing or unexpected tensor, its config keeps the source's keys, and transformers' loss of
     it on a batch equals `strata eval`'s (relative 1e-5).
  4. bf16 weights: step 1's loss (both sides compute in fp32 from the same bf16 weights).
  5. LoRA with PEFT's module names (r 4 on q, k, v, o, gate, up, down; the base, biases
     included, frozen: PEFT's bias="none"): 3 steps of Strata; PEFT loads the adapters
     (PeftModel.from_pretrained) with the loss `strata eval` gives them (relative 1e-5), and
     every base tensor, biases and norms included, is bit for bit the one it started from.
For the RoPE scalings the check first shows that the scaling matters: transformers' loss with
the default RoPE on the same weights must differ from the scaled one by over 100 times the
tolerance, or the comparison could not tell them apart.

Usage: hf_families.py --strata BIN --work DIR [--json FILE] [--cases a,b]. Exit 0 when every
check holds, 1 otherwise (each failure is printed).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file
from peft import PeftModel
from transformers import (AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config,
                          Qwen3Config)

SEQ = 64
MICRO_BATCH = 4
VOCAB = 256
STEPS = 20
INIT_STD = 0.1
RTOL_LOSS = 1e-5
RTOL_GRAD = 1e-4
RTOL_TRAIN_LOSS = 1e-4
RTOL_WEIGHTS = 1e-3

SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
             rms_norm_eps=1e-5, initializer_range=INIT_STD)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16, "rope_theta": 500000.0}


def cases():
    """name -> (config class, its arguments, the class AutoModelForCausalLM must load)."""
    return {
        "llama3.1": (LlamaConfig, dict(SHAPE, rope_parameters=LLAMA3), "LlamaForCausalLM"),
        "llama-bias": (LlamaConfig, dict(SHAPE, attention_bias=True, mlp_bias=True,
                                         rope_theta=10000.0), "LlamaForCausalLM"),
        "llama-yarn": (LlamaConfig, dict(SHAPE, rope_parameters={
            "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16,
            "rope_theta": 10000.0}), "LlamaForCausalLM"),
        "llama-linear": (LlamaConfig, dict(SHAPE, rope_parameters={
            "rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}), "LlamaForCausalLM"),
        "mistral-head-dim": (MistralConfig, dict(SHAPE, head_dim=32, sliding_window=128,
                                                 rope_theta=1000000.0), "MistralForCausalLM"),
        "qwen2": (Qwen2Config, dict(SHAPE, rope_theta=1000000.0, tie_word_embeddings=True),
                  "Qwen2ForCausalLM"),
        "qwen3": (Qwen3Config, dict(SHAPE, head_dim=32, rope_theta=1000000.0),
                  "Qwen3ForCausalLM"),
    }


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stdout[-2000:]}\n"
                           f"{r.stderr[-2000:]}")
    return r.stdout


def batches(tokens, n):
    """Strata's first n global batches with --sampling sequential on one rank."""
    out = []
    for b in range(n):
        rows = [tokens[(b * MICRO_BATCH + i) * SEQ:(b * MICRO_BATCH + i) * SEQ + SEQ + 1]
                for i in range(MICRO_BATCH)]
        out.append(torch.from_numpy(np.stack(rows).astype(np.int64)))
    return out


def hf_loss(model, rows):
    logits = model(input_ids=rows[:, :-1]).logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1))


def make_model(cls, args, dtype, seed):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cls(**args))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.1)
            elif name.endswith("q_norm.weight") or name.endswith("k_norm.weight"):
                p.normal_(1.0, 0.1)
    return model.to(dtype)


def ds_config(path, lr, betas, weight_decay):
    with open(path, "w") as f:
        json.dump({"train_micro_batch_size_per_gpu": MICRO_BATCH,
                   "optimizer": {"type": "AdamW", "params": {
                       "lr": lr, "betas": betas, "eps": 1e-8, "weight_decay": weight_decay}},
                   "zero_optimization": {"stage": 0}}, f)
    return path


def strata_train(args, model_dir, data, work, name, steps, cfg, save=None):
    metrics = os.path.join(work, f"metrics-{name}.jsonl")
    cmd = [args.strata, "train", "--config", cfg, "--model", model_dir, "--data", data,
           "--data-dtype", "uint16", "--seq-len", str(SEQ), "--steps", str(steps),
           "--sampling", "sequential", "--device", "cpu", "--metrics", metrics]
    if save:
        cmd += ["--save", save]
    run(cmd)
    with open(metrics) as f:
        return [json.loads(line)["loss"] for line in f if line.strip()]


def rel(a, b):
    return float(abs(a - b) / max(abs(b), 1e-30))


def rel_norm(a, b):
    return float((a - b).norm() / max(b.norm(), 1e-30))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--strata", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--json", default=None)
    ap.add_argument("--cases", default="")
    args = ap.parse_args()
    work = os.path.abspath(args.work)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    torch.set_num_threads(1)
    print(f"hf_families: transformers {transformers.__version__}, torch {torch.__version__}")
    data = os.path.join(work, "tokens.bin")
    rng = np.random.default_rng(7)
    rng.integers(0, VOCAB, (STEPS * MICRO_BATCH + 1) * SEQ + 1, dtype=np.uint16).tofile(data)
    tokens = np.fromfile(data, dtype="<u2")
    steps = batches(tokens, STEPS)
    results, failures = [], []

    def check(case, what, value, tol):
        ok = value <= tol
        results.append({"case": case, "check": what, "value": value, "tol": tol, "ok": ok})
        print(f"  {case:<18} {what:<48} {value:.2e} (tol {tol:g}) {'ok' if ok else 'FAIL'}")
        if not ok:
            failures.append(f"{case}: {what} {value:.2e} > {tol:g}")

    chosen = [c for c in args.cases.split(",") if c] or list(cases())
    for seed, name in enumerate(chosen):
        cls, cfg_args, arch = cases()[name]
        t0 = time.time()
        d = os.path.join(work, name)
        model = make_model(cls, cfg_args, torch.float32, 100 + seed)
        model.save_pretrained(d)

        # The RoPE scaling must move the loss, or the checks below could not see it ignored.
        rope = cfg_args.get("rope_parameters")
        if rope and rope.get("rope_type", "default") != "default":
            plain = dict(cfg_args, rope_parameters={"rope_type": "default",
                                                    "rope_theta": rope["rope_theta"]})
            unscaled = AutoModelForCausalLM.from_config(cls(**plain))
            unscaled.load_state_dict(model.state_dict())
            with torch.no_grad():
                gap = rel(hf_loss(unscaled, steps[0]).item(), hf_loss(model, steps[0]).item())
            print(f"  {name:<18} the default RoPE moves transformers' loss by {gap:.2e}")
            if gap < 100 * RTOL_LOSS:
                failures.append(f"{name}: the RoPE scaling moves the loss by only {gap:.2e}")

        # 1. Loss and gradients of the first batch.
        model.zero_grad()
        loss = hf_loss(model, steps[0])
        loss.backward()
        grad_cfg = ds_config(os.path.join(work, f"ds-grad-{name}.json"), 1e-30, [0.0, 0.0], 0.0)
        ckpt = os.path.join(work, f"grad-{name}")
        ours = strata_train(args, d, data, work, f"grad-{name}", 1, grad_cfg, save=ckpt)[0]
        check(name, "loss of batch 1", rel(ours, loss.item()), RTOL_LOSS)
        moments = load_file(os.path.join(ckpt, "latest", "optimizer.safetensors"))
        worst, worst_name = 0.0, ""
        names = dict(model.named_parameters())
        for pname, p in names.items():
            key = "exp_avg." + pname
            if key not in moments:
                if not (pname == "lm_head.weight" and model.config.tie_word_embeddings):
                    failures.append(f"{name}: no gradient for {pname} in Strata's checkpoint")
                continue
            e = rel_norm(moments[key].float(), p.grad.float())
            if e > worst:
                worst, worst_name = e, pname
        check(name, f"worst gradient ({worst_name})", worst, RTOL_GRAD)

        # 2. Twenty AdamW steps.
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                                weight_decay=0.01)
        theirs = []
        for rows in steps:
            opt.zero_grad()
            loss = hf_loss(model, rows)
            loss.backward()
            opt.step()
            theirs.append(loss.item())
        train_cfg = ds_config(os.path.join(work, f"ds-train-{name}.json"), 1e-3, [0.9, 0.999], 0.01)
        ckpt = os.path.join(work, f"train-{name}")
        ours = strata_train(args, d, data, work, f"train-{name}", STEPS, train_cfg, save=ckpt)
        check(name, f"{STEPS} AdamW steps: worst step loss",
              max(rel(a, b) for a, b in zip(ours, theirs)), RTOL_TRAIN_LOSS)
        latest = os.path.join(ckpt, "latest")
        saved = load_file(os.path.join(latest, "model.safetensors"))
        check(name, f"{STEPS} AdamW steps: worst final weight",
              max(rel_norm(saved[k].float(), p.detach().float())
                  for k, p in model.named_parameters() if k in saved), RTOL_WEIGHTS)

        # 3. The checkpoint in transformers, as the same class.
        loaded, info = AutoModelForCausalLM.from_pretrained(latest, dtype=torch.float32,
                                                            output_loading_info=True)
        missing = [k for k in info["missing_keys"]
                   if not (k == "lm_head.weight" and loaded.config.tie_word_embeddings)]
        if type(loaded).__name__ != arch or missing or info["unexpected_keys"]:
            failures.append(f"{name}: the checkpoint loads as {type(loaded).__name__} "
                            f"(expected {arch}); missing {missing}, unexpected "
                            f"{info['unexpected_keys']}")
        with open(os.path.join(latest, "config.json")) as f:
            written = json.load(f)
        with open(os.path.join(d, "config.json")) as f:
            source = json.load(f)
        lost = [k for k in source if k not in written]
        if lost:
            failures.append(f"{name}: the checkpoint's config.json lost {lost}")
        with torch.no_grad():
            theirs_eval = hf_loss(loaded, torch.cat(steps[:2])).item()
        result = os.path.join(work, f"eval-{name}.json")
        run([args.strata, "eval", "--model", latest, "--data", data, "--data-dtype", "uint16",
             "--seq-len", str(SEQ), "--sequences", str(2 * MICRO_BATCH), "--micro-batch",
             str(MICRO_BATCH), "--device", "cpu", "--json", result])
        with open(result) as f:
            check(name, "checkpoint: strata eval vs transformers", rel(json.load(f)["loss"],
                                                                     theirs_eval), RTOL_LOSS)

        # 4. bf16 weights: the first loss.
        d16 = os.path.join(work, name + "-bf16")
        make_model(cls, cfg_args, torch.bfloat16, 100 + seed).save_pretrained(d16)
        with torch.no_grad():
            theirs16 = hf_loss(AutoModelForCausalLM.from_pretrained(d16, dtype=torch.float32),
                               steps[0]).item()
        ours16 = strata_train(args, d16, data, work, f"bf16-{name}", 1, grad_cfg)[0]
        check(name, "bf16 weights: loss of batch 1", rel(ours16, theirs16), RTOL_LOSS)
        # 5. LoRA with PEFT's names, loaded by PEFT.
        lora_cfg = os.path.join(work, f"ds-lora-{name}.json")
        with open(lora_cfg, "w") as f:
            json.dump({"train_micro_batch_size_per_gpu": MICRO_BATCH,
                       "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                       "zero_optimization": {"stage": 0},
                       "strata": {"lora": {"r": 4, "lora_alpha": 8,
                                           "target_modules": "all-linear"}}}, f)
        ckpt = os.path.join(work, f"lora-{name}")
        strata_train(args, d, data, work, f"lora-{name}", 3, lora_cfg, save=ckpt)
        step = os.path.realpath(os.path.join(ckpt, "latest"))
        peft_model = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32), step)
        with torch.no_grad():
            peft_loss = hf_loss(peft_model, torch.cat(steps[:2])).item()
        result = os.path.join(work, f"eval-lora-{name}.json")
        run([args.strata, "eval", "--model", step, "--data", data, "--data-dtype", "uint16",
             "--seq-len", str(SEQ), "--sequences", str(2 * MICRO_BATCH), "--micro-batch",
             str(MICRO_BATCH), "--device", "cpu", "--json", result])
        with open(result) as f:
            check(name, "LoRA: strata eval vs PEFT", rel(json.load(f)["loss"], peft_loss),
                  RTOL_LOSS)
        before = load_file(os.path.join(d, "model.safetensors"))
        after = load_file(os.path.join(step, "model.safetensors"))
        changed = [k for k in before if not torch.equal(before[k], after[k])]
        if changed:
            failures.append(f"{name}: LoRA changed base tensors {changed[:3]}")
        print(f"  {name}: {time.time() - t0:.0f} s")

    out = {"test": "hf_families", "transformers": transformers.__version__,
           "torch": torch.__version__, "results": results, "failures": failures}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if failures:
        print("FAIL:", "; ".join(failures))
        return 1
    print(f"PASS: {len(results)} checks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
