#!/usr/bin/env python3
"""lora_peft.py: Strata's LoRA adapters against the real PEFT library, both ways.

Runs under the environment deploy/hf-venv.sh makes (peft, transformers and torch from PyPI). A small
Llama with grouped-query attention, written by transformers' save_pretrained:

  1. Strata -> PEFT: `strata train` with strata.lora (r 4, alpha 8, all seven projections,
     ZeRO-3) from those weights for 8 steps, saved. The checkpoint's step directory loads as an
     adapter with `PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(BASE), DIR)`, and
     PEFT's loss on 16 held-out sequences matches `strata eval --model DIR --adapter DIR` on
     them; so do transformers' `from_pretrained(DIR)` alone and `strata eval --model DIR`. The
     base weights in the checkpoint are bit for bit the ones it started from.
  2. `strata checkpoint merge-lora` against PEFT's merge_and_unload(): every merged weight within
     1e-6 of PEFT's, and transformers' loss of the merged directory matches PEFT's.
  3. PEFT -> Strata: an adapter PEFT made (get_peft_model with random B, q_proj and v_proj, r 8,
     alpha 16) and wrote as save_pretrained does is applied by `strata eval --adapter` with PEFT's
     loss on the same sequences.

Tolerance: both sides compute in fp32 from the same weights: relative 1e-5 on losses.

Usage: lora_peft.py --strata BIN --work DIR. Exit 0 when every check holds, 1 otherwise.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

import peft
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict

SEQ = 32
VOCAB = 256
EVAL_SEQUENCES = 16
RTOL = 1e-5


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stdout[-3000:]}\n"
                           f"{r.stderr[-3000:]}")
    return r.stdout


def eval_rows(tokens):
    rows = [tokens[w * SEQ:w * SEQ + SEQ + 1] for w in range(EVAL_SEQUENCES)]
    return torch.from_numpy(np.stack(rows).astype(np.int64))


def loss_of(model, rows):
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=rows[:, :-1]).logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1)).item()


def strata_eval(args, work, name, model, data, adapter=None):
    out = os.path.join(work, f"eval-{name}.json")
    cmd = [args.strata, "eval", "--model", model, "--data", data, "--data-dtype", "uint16",
           "--seq-len", str(SEQ), "--sequences", str(EVAL_SEQUENCES), "--micro-batch", "4",
           "--device", "cpu", "--json", out]
    if adapter:
        cmd += ["--adapter", adapter]
    run(cmd)
    with open(out) as f:
        return float(json.load(f)["loss"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--strata", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    work = os.path.abspath(args.work)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"lora_peft: peft {peft.__version__}, torch {torch.__version__}")
    failures = []

    def check(what, ours, theirs, rtol=RTOL, ours_name="strata"):
        rel = abs(ours - theirs) / max(abs(theirs), 1e-30)
        ok = rel <= rtol
        print(f"  {'ok  ' if ok else 'FAIL'} {what}: {ours_name} {ours:.7f}, peft {theirs:.7f}, "
              f"relative {rel:.2e} (tolerance {rtol:g})")
        if not ok:
            failures.append(what)

    base = os.path.join(work, "base")
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=160,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(base, safe_serialization=True)
    rng = np.random.default_rng(5)
    train = os.path.join(work, "train.bin")
    rng.integers(0, VOCAB, 20000, dtype=np.uint16).astype("<u2").tofile(train)
    valid = os.path.join(work, "valid.bin")
    rng.integers(0, VOCAB, 4000, dtype=np.uint16).astype("<u2").tofile(valid)
    rows = eval_rows(np.fromfile(valid, dtype="<u2"))

    # 1. Strata trains the adapters; PEFT loads them.
    ds = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
          "strata": {"lora": {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}}}
    with open(os.path.join(work, "ds.json"), "w") as f:
        json.dump(ds, f)
    ckpt = os.path.join(work, "ckpt")
    run([args.strata, "train", "--config", os.path.join(work, "ds.json"), "--model", base,
         "--data", train, "--data-dtype", "uint16", "--seq-len", str(SEQ), "--steps", "8",
         "--device", "cpu", "--save", ckpt])
    step = os.path.join(ckpt, "latest")
    before, after = load_file(os.path.join(base, "model.safetensors")), \
        load_file(os.path.join(step, "model.safetensors"))
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    print(f"  {'ok  ' if not changed else 'FAIL'} base weights unchanged by LoRA training "
          f"({len(before)} tensors){': ' + ', '.join(changed) if changed else ''}")
    if changed:
        failures.append("base weights changed")
    model = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base), step)
    adapters = load_file(os.path.join(step, "adapter_model.safetensors"))
    moved = max(float(t.abs().max()) for n, t in adapters.items() if "lora_B" in n)
    print(f"  {'ok  ' if moved > 0 else 'FAIL'} trained lora_B tensors are non-zero "
          f"(largest |value| {moved:.3g}; PEFT starts them at 0)")
    if not moved > 0:
        failures.append("lora_B did not train")
    peft_loss = loss_of(model, rows)
    check("strata eval --adapter of the checkpoint vs PEFT",
          strata_eval(args, work, "trained", step, valid, adapter=step), peft_loss)
    # The step directory alone: its adapter_config.json names the directory itself as the base,
    # so transformers (with PEFT installed) loads its base weights and then its adapters, and
    # strata eval --model DIR takes its adapters too.
    check("transformers' from_pretrained of the step directory vs PEFT",
          loss_of(LlamaForCausalLM.from_pretrained(step), rows), peft_loss,
          ours_name="transformers")
    check("strata eval --model of the step directory vs PEFT",
          strata_eval(args, work, "step", step, valid), peft_loss)

    # 2. Merging.
    merged = os.path.join(work, "merged")
    run([args.strata, "checkpoint", "merge-lora", "--base", step, "--adapter", step,
         "--out", merged])
    theirs = model.merge_and_unload().state_dict()
    ours = load_file(os.path.join(merged, "model.safetensors"))
    worst = max(float((ours[n] - theirs[n]).abs().max()) for n in ours)
    missing = sorted(set(theirs) ^ set(ours))
    ok = worst <= 1e-6 and not missing
    print(f"  {'ok  ' if ok else 'FAIL'} merge-lora vs PEFT merge_and_unload: max |diff| "
          f"{worst:.2e} over {len(ours)} tensors{'; differing names ' + str(missing) if missing else ''}")
    if not ok:
        failures.append("merge-lora")
    check("transformers on the merged directory vs PEFT",
          loss_of(LlamaForCausalLM.from_pretrained(merged), rows), peft_loss,
          ours_name="transformers")
    check("strata eval of the merged directory vs PEFT",
          strata_eval(args, work, "merged", merged, valid), peft_loss)

    # 3. PEFT's own adapter in Strata.
    pmodel = get_peft_model(LlamaForCausalLM.from_pretrained(base),
                            LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                       target_modules=["q_proj", "v_proj"],
                                       init_lora_weights=False))
    peft_dir = os.path.join(work, "peft-adapter")
    # What save_pretrained writes, by PEFT's own functions (save_pretrained itself also writes a
    # model card, which needs Jinja2, not in this environment).
    os.makedirs(peft_dir)
    save_file(get_peft_model_state_dict(pmodel),
              os.path.join(peft_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
    pmodel.peft_config["default"].save_pretrained(peft_dir)
    check("strata eval --adapter of PEFT's save_pretrained vs PEFT",
          strata_eval(args, work, "peft", base, valid, adapter=peft_dir), loss_of(pmodel, rows))

    if failures:
        print(f"FAIL: {len(failures)} check(s): {', '.join(failures)}")
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
