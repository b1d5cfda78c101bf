#!/usr/bin/env python3
"""hf_roundtrip.py: Strata and Hugging Face transformers, both ways, with the real libraries.

Runs under the environment deploy/hf-venv.sh makes (transformers, safetensors and peft from
PyPI at pinned versions, Debian's torch). A small Llama with grouped-query attention (4 heads,
2 KV heads), tied and untied embeddings:

  1. transformers -> Strata: a model written by `save_pretrained` (one file, and sharded with an
     index; fp32 and bf16 weights) is loaded by `strata train --model DIR`, and the loss of
     Strata's first step (the loaded weights on the first batch, before any update) matches
     transformers' own loss on the same batch.
  2. Strata -> transformers: a checkpoint `strata train --save` wrote after 3 steps (one file and
     sharded; fp32 and bf16 training) loads with `LlamaForCausalLM.from_pretrained` with no
     missing or unexpected tensor, and transformers' loss on a batch matches Strata's own loss
     of those weights on that batch.
     `strata eval` of the model on 16 sequences matches transformers' mean loss on them.
  3. Mistral (the same decoder with sliding-window attention) both ways, within its window.
  4. Configs transformers writes that Strata does not implement (rope scaling, attention biases,
     another architecture, a Mistral window shorter than the sequence) are refused by
     `strata train` with a message naming the key.

Tolerance: both sides compute in fp32 from the same (fp32 or bf16) weights; the loss may differ
by the order of summation only: relative 1e-5. With bf16 compute in Strata (activations rounded
to bf16) against transformers in fp32: relative 2e-2.

Usage: hf_roundtrip.py --strata BIN --work DIR [--json FILE]. Exit 0 when every check holds, 1
otherwise (each failure is printed).
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
import transformers
from transformers import (AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Qwen2Config)

SEQ = 32
MICRO_BATCH = 4
VOCAB = 256
RTOL_FP32 = 1e-5
RTOL_BF16 = 2e-2


def llama_config(tied, **extra):
    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=160,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0,
                       tie_word_embeddings=tied, **extra)


def write_tokens(path, n):
    rng = np.random.default_rng(5)
    rng.integers(0, VOCAB, n, dtype=np.uint16).astype("<u2").tofile(path)
    return np.fromfile(path, dtype="<u2")


def first_batch(tokens):
    """Strata's first global batch with --sampling sequential on one rank: windows 0..B-1."""
    rows = [tokens[w * SEQ:w * SEQ + SEQ + 1] for w in range(MICRO_BATCH)]
    return torch.from_numpy(np.stack(rows).astype(np.int64))


def hf_loss(model_dir, rows):
    """transformers' loss of the weights in model_dir on rows, in fp32; and the loading info."""
    model, info = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32,
                                                       output_loading_info=True)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=rows[:, :-1]).logits.float()
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1))
    return loss.item(), info


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    return r.returncode, r.stdout, r.stderr


def ds_config(path, bf16=False):
    cfg = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
           "zero_optimization": {"stage": 0}}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path


def strata_train(args, model, data, work, name, steps, bf16=False, save=None, shard=None):
    metrics = os.path.join(work, f"metrics-{name}.jsonl")
    cmd = [args.strata, "train", "--config", ds_config(os.path.join(work, f"ds-{name}.json"), bf16),
           "--model", model, "--data", data, "--data-dtype", "uint16", "--seq-len", str(SEQ),
           "--steps", str(steps), "--sampling", "sequential", "--device", "cpu",
           "--metrics", metrics]
    if save:
        cmd += ["--save", save]
    if shard:
        cmd += ["--save-shard-size", shard]
    rc, out, err = run(cmd)
    if rc != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {rc}:\n{out[-2000:]}\n{err[-2000:]}")
    with open(metrics) as f:
        return [json.loads(line)["loss"] for line in f if line.strip()]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--strata", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    work = os.path.abspath(args.work)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    torch.set_num_threads(1)
    print(f"hf_roundtrip: transformers {transformers.__version__}, torch {torch.__version__}")

    data = os.path.join(work, "tokens.bin")
    rows = first_batch(write_tokens(data, 20000))
    results, failures = [], []

    def check(case, ours, theirs, rtol, note=""):
        rel = abs(ours - theirs) / abs(theirs)
        ok = rel <= rtol
        results.append({"case": case, "strata": ours, "transformers": theirs, "rel": rel,
                        "rtol": rtol, "ok": ok, "note": note})
        print(f"  {case:<58} strata {ours:.7f}  transformers {theirs:.7f}  rel {rel:.2e} "
              f"(tol {rtol:g}) {'ok' if ok else 'FAIL'}")
        if not ok:
            failures.append(case)

    # 1. transformers -> Strata.
    print("1. save_pretrained -> strata train --model (loss of step 1, before any update)")
    for tied in (False, True):
        for dtype in (torch.float32, torch.bfloat16):
            for shard in (None, "60KB"):
                name = (f"hf-{'tied' if tied else 'untied'}-{str(dtype).split('.')[-1]}"
                        f"-{'sharded' if shard else 'single'}")
                d = os.path.join(work, name)
                torch.manual_seed(11)
                model = LlamaForCausalLM(llama_config(tied)).to(dtype)
                model.save_pretrained(d, safe_serialization=True, max_shard_size=shard or "10GB")
                index = os.path.exists(os.path.join(d, "model.safetensors.index.json"))
                if index != bool(shard):
                    failures.append(f"{name}: sharded {index}, expected {bool(shard)}")
                theirs, _ = hf_loss(d, rows)
                ours = strata_train(args, d, data, work, name, steps=1)[0]
                check(name, ours, theirs, RTOL_FP32)
                if not tied and shard is None:
                    ours16 = strata_train(args, d, data, work, name + "-bf16", steps=1, bf16=True)[0]
                    check(name + ", Strata in bf16", ours16, theirs, RTOL_BF16,
                          "activations rounded to bf16 in Strata")

    # 2. Strata -> transformers.
    print("2. strata train --save -> LlamaForCausalLM.from_pretrained")
    for tied in (False, True):
        base = os.path.join(work, f"hf-{'tied' if tied else 'untied'}-float32-single")
        for bf16 in (False, True):
            for shard in (None, "64KiB"):
                name = (f"strata-{'tied' if tied else 'untied'}-{'bf16' if bf16 else 'fp32'}"
                        f"-{'sharded' if shard else 'single'}")
                ckpt = os.path.join(work, name)
                strata_train(args, base, data, work, name + "-train", steps=3, bf16=bf16,
                             save=ckpt, shard=shard)
                latest = os.path.join(ckpt, "latest")
                index = os.path.exists(os.path.join(latest, "model.safetensors.index.json"))
                if index != bool(shard):
                    failures.append(f"{name}: sharded {index}, expected {bool(shard)}")
                theirs, info = hf_loss(latest, rows)
                # transformers names the tied head's weight missing only when it was not tied.
                missing = [k for k in info["missing_keys"] if not (tied and k == "lm_head.weight")]
                if missing or info["unexpected_keys"] or info["mismatched_keys"]:
                    failures.append(f"{name}: loading info {info}")
                    print(f"  {name}: FAIL: loading info {info}")
                ours = strata_train(args, latest, data, work, name + "-eval", steps=1)[0]
                check(name, ours, theirs, RTOL_FP32,
                      "bf16 weights, fp32 compute on both sides" if bf16 else "")

    # strata eval on 16 sequences against transformers' mean loss over the same windows.
    d = os.path.join(work, "hf-untied-float32-single")
    tokens = np.fromfile(data, dtype="<u2")
    windows = torch.from_numpy(np.stack([tokens[w * SEQ:w * SEQ + SEQ + 1]
                                         for w in range(16)]).astype(np.int64))
    theirs, _ = hf_loss(d, windows)
    result = os.path.join(work, "eval.json")
    rc, out_, err = run([args.strata, "eval", "--model", d, "--data", data, "--data-dtype",
                         "uint16", "--seq-len", str(SEQ), "--sequences", "16", "--micro-batch", "4",
                         "--device", "cpu", "--json", result])
    if rc != 0:
        failures.append(f"strata eval exited {rc}: {err[-500:]}")
    else:
        with open(result) as f:
            check("strata eval, 16 sequences", json.load(f)["loss"], theirs, RTOL_FP32)

    # 3. Mistral within its sliding window: the same math as Llama's full causal attention.
    print("3. Mistral (sliding_window >= the sequence) both ways")
    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                 rms_norm_eps=1e-5, rope_theta=10000.0)
    d = os.path.join(work, "hf-mistral")
    torch.manual_seed(12)
    MistralForCausalLM(MistralConfig(sliding_window=64, **shape)).save_pretrained(d)
    theirs, _ = hf_loss(d, rows)
    check("hf-mistral (sliding_window 64, sequence 32)",
          strata_train(args, d, data, work, "mistral", steps=1)[0], theirs, RTOL_FP32)
    ckpt = os.path.join(work, "strata-mistral")
    strata_train(args, d, data, work, "mistral-train", steps=3, save=ckpt)
    with open(os.path.join(ckpt, "latest", "config.json")) as f:
        written = json.load(f)
    if written.get("model_type") != "mistral" or written.get("sliding_window") != 64:
        failures.append(f"strata-mistral: config.json has model_type {written.get('model_type')}, "
                        f"sliding_window {written.get('sliding_window')}")
    theirs, info = hf_loss(os.path.join(ckpt, "latest"), rows)
    if info["missing_keys"] or info["unexpected_keys"]:
        failures.append(f"strata-mistral: loading info {info}")
    check("strata-mistral -> MistralForCausalLM",
          strata_train(args, os.path.join(ckpt, "latest"), data, work, "mistral-eval", steps=1)[0],
          theirs, RTOL_FP32)

    # 4. What Strata does not implement is refused, naming the key.
    print("4. configs Strata does not implement")
    refusals = [
        ("rope_scaling", llama_config(False, rope_scaling={"type": "linear", "factor": 2.0})),
        ("attention_bias", llama_config(False, attention_bias=True)),
        ("model_type", Qwen2Config(**shape)),
        ("sliding_window", MistralConfig(sliding_window=16, **shape)),
    ]
    for key, cfg in refusals:
        d = os.path.join(work, "refuse-" + key)
        cfg.save_pretrained(d)
        rc, out, err = run([args.strata, "train", "--config", ds_config(os.path.join(work, "ds-r.json")),
                            "--model", d, "--data", data, "--data-dtype", "uint16", "--seq-len",
                            str(SEQ), "--steps", "1", "--device", "cpu"])
        line = (err.strip().splitlines() or [""])[-1]
        ok = rc != 0 and key in err
        print(f"  {key:<20} exit {rc}: {line[:160]} {'ok' if ok else 'FAIL'}")
        results.append({"case": "refuse " + key, "exit": rc, "message": line, "ok": ok})
        if not ok:
            failures.append(f"refuse {key}: exit {rc}, {line}")

    out = {"test": "hf_roundtrip", "transformers": transformers.__version__,
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
