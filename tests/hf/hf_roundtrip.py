#!/usr/bin/env python3
"""hf_roundtrip.py: Strata and Hugging Face transformers, both ways, with the real libraries.

Runs under the environment deploy/hf-venv.sh makes (transformers, safetensors and peft from
PyPI at pinned versions: transformers 5, torch 2). A small Llama with grouped-query attention (4 heads,
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
  4. Configs transformers writes that Strata does not implement (a RoPE type it does not compute,
     attention dropout, another architecture, a Mistral window shorter than the sequence) are
     refused by `strata train` with a message naming the key. (The families Strata does train
     are checked against transformers in hf_families.py.)
  5. RoPE settings as transformers 5 writes them (`rope_parameters`, no top-level rope_theta): a
     model with rope_theta 500000 and query/key weights large enough that attention depends on
     position (the check first shows that theta 10000 gives another loss) gives transformers'
     loss in `strata eval`, and the checkpoint Strata writes from it loads in transformers with
     the same base and the same loss.
  6. pad_token_id: as nn.Embedding's padding_idx in transformers, the pad token's row of the
     embedding gets no gradient from its lookups: after 3 steps of training (no weight decay) on
     data full of that token its row is bit for bit the initial one, while every other row that
     was looked up has moved; the written config keeps pad_token_id.

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
from transformers import (AutoModelForCausalLM, GemmaConfig, LlamaConfig, LlamaForCausalLM,
                          MistralConfig, MistralForCausalLM)

SEQ = 32
MICRO_BATCH = 4
VOCAB = 256
RTOL_FP32 = 1e-5
RTOL_BF16 = 2e-2
# The RoPE check's weights: drawn with this std (transformers' default 0.02 leaves attention
# nearly uniform, and a wrong base hides), query and key weights then scaled by QK_SCALE. With
# these, the bases 500000 and 10000 give losses about 1e-2 apart, 1000 times the tolerance.
ROPE_INIT_STD = 0.1
QK_SCALE = 4.0


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
    model, info = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
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
        # A RoPE type Strata does not compute, in transformers 5's place and in transformers 4's.
        ("rope_parameters.rope_type", {"model_type": "llama", **shape, "rope_parameters": {
            "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
            "long_factor": [1.0] * 8, "original_max_position_embeddings": 64}}),
        ("rope_scaling.type", {"model_type": "llama", **shape,
                               "rope_scaling": {"type": "longrope", "factor": 2.0}}),
        ("attention_dropout", llama_config(False, attention_dropout=0.1)),
        ("model_type", GemmaConfig(**shape)),
        ("sliding_window", MistralConfig(sliding_window=16, **shape)),
    ]
    for key, cfg in refusals:
        d = os.path.join(work, "refuse-" + key)
        if isinstance(cfg, dict):  # a config.json as an older transformers wrote it
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, "config.json"), "w") as f:
                json.dump(cfg, f)
        else:
            cfg.save_pretrained(d)
        rc, out, err = run([args.strata, "train", "--config", ds_config(os.path.join(work, "ds-r.json")),
                            "--model", d, "--data", data, "--data-dtype", "uint16", "--seq-len",
                            str(SEQ), "--steps", "1", "--device", "cpu"])
        line = (err.strip().splitlines() or [""])[-1]
        # The key must be named in the message, not only in the directory's name.
        message = line.split("config.json:", 1)[-1] if "config.json:" in line else line
        message = message.split(d, 1)[-1]
        ok = rc != 0 and key in message
        print(f"  {key:<20} exit {rc}: {line[:160]} {'ok' if ok else 'FAIL'}")
        results.append({"case": "refuse " + key, "exit": rc, "message": line, "ok": ok})
        if not ok:
            failures.append(f"refuse {key}: exit {rc}, {line}")

    # 5. RoPE settings where transformers 5 writes them.
    print("5. rope_parameters (transformers 5): rope_theta 500000, attention that depends on position")
    d = os.path.join(work, "hf-theta")
    torch.manual_seed(13)
    model = LlamaForCausalLM(LlamaConfig(**dict(shape, rope_theta=500000.0,
                                                 initializer_range=ROPE_INIT_STD)))
    with torch.no_grad():  # attention far from uniform, so that the base moves the loss
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(QK_SCALE)
            layer.self_attn.k_proj.weight.mul_(QK_SCALE)
    model.save_pretrained(d)
    with open(os.path.join(d, "config.json")) as f:
        saved = json.load(f)
    where = saved.get("rope_parameters", {}).get("rope_theta")
    print(f"  config.json: rope_parameters {saved.get('rope_parameters')}, "
          f"rope_theta {saved.get('rope_theta', '(absent)')}")
    if where != 500000.0:
        failures.append(f"hf-theta: transformers wrote rope_parameters {saved.get('rope_parameters')}")
    theirs, _ = hf_loss(d, windows)
    # The same weights with the default base: the loss must move well past the tolerance, or
    # this check could not tell a wrong base from the right one.
    wrong_dir = os.path.join(work, "hf-theta-10000")
    model.config.rope_parameters["rope_theta"] = 10000.0
    model.save_pretrained(wrong_dir)
    wrong, _ = hf_loss(wrong_dir, windows)
    gap = abs(wrong - theirs) / abs(theirs)
    print(f"  transformers: theta 500000 {theirs:.5f}, theta 10000 {wrong:.5f} (rel {gap:.2e})")
    if gap < 100 * RTOL_FP32:
        failures.append(f"hf-theta: the base moves the loss only by {gap:.2e}; the check is blind")
    rc, out_, err = run([args.strata, "eval", "--model", d, "--data", data, "--data-dtype",
                         "uint16", "--seq-len", str(SEQ), "--sequences", "16", "--micro-batch", "4",
                         "--device", "cpu", "--json", result])
    if rc != 0:
        failures.append(f"strata eval (hf-theta) exited {rc}: {err[-500:]}")
    else:
        with open(result) as f:
            check("hf-theta: strata eval (rope_parameters.rope_theta 500000)",
                  json.load(f)["loss"], theirs, RTOL_FP32)
    ckpt = os.path.join(work, "strata-theta")
    strata_train(args, d, data, work, "theta-train", steps=3, save=ckpt)
    latest = os.path.join(ckpt, "latest")
    base = transformers.AutoConfig.from_pretrained(latest).rope_parameters["rope_theta"]
    if base != 500000.0:
        failures.append(f"strata-theta: transformers reads rope_theta {base} from Strata's config")
    theirs, info = hf_loss(latest, rows)
    if info["missing_keys"] or info["unexpected_keys"]:
        failures.append(f"strata-theta: loading info {info}")
    check("strata-theta -> transformers (rope_theta 500000)",
          strata_train(args, latest, data, work, "theta-eval", steps=1)[0], theirs, RTOL_FP32)

    # 6. pad_token_id, transformers' padding_idx.
    print("6. pad_token_id: the pad token's embedding row gets no gradient")
    pad = 3
    d = os.path.join(work, "hf-pad")
    torch.manual_seed(14)
    LlamaForCausalLM(LlamaConfig(**dict(shape, pad_token_id=pad))).save_pretrained(d)
    ds = os.path.join(work, "ds-pad.json")
    with open(ds, "w") as f:
        json.dump({"train_micro_batch_size_per_gpu": MICRO_BATCH,
                   "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
                   "zero_optimization": {"stage": 0}}, f)
    ckpt = os.path.join(work, "strata-pad")
    rc, out_, err = run([args.strata, "train", "--config", ds, "--model", d, "--data", data,
                         "--data-dtype", "uint16", "--seq-len", str(SEQ), "--steps", "3",
                         "--sampling", "sequential", "--device", "cpu", "--save", ckpt])
    if rc != 0:
        failures.append(f"strata train (hf-pad) exited {rc}: {err[-500:]}")
    else:
        from safetensors.torch import load_file
        before = load_file(os.path.join(d, "model.safetensors"))["model.embed_tokens.weight"]
        after = load_file(os.path.join(ckpt, "latest", "model.safetensors"))["model.embed_tokens.weight"]
        # The inputs of the 3 steps' sequential windows (a window's last token is only a target).
        used = torch.from_numpy(tokens[:3 * MICRO_BATCH * SEQ].astype(np.int64)).unique()
        moved = [int(t) for t in used if t != pad and torch.equal(before[t], after[t])]
        with open(os.path.join(ckpt, "latest", "config.json")) as f:
            kept = json.load(f).get("pad_token_id")
        ok = (pad in used.tolist() and torch.equal(before[pad], after[pad]) and not moved
              and kept == pad)
        print(f"  pad row unchanged {torch.equal(before[pad], after[pad])}, "
              f"{len(used) - 1} other looked-up rows moved (unmoved: {moved}), "
              f"config pad_token_id {kept}: {'ok' if ok else 'FAIL'}")
        results.append({"case": "pad_token_id row", "ok": ok})
        if not ok:
            failures.append("pad_token_id: the pad row moved, another did not, or the key was lost")

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
