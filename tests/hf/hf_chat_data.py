#!/usr/bin/env python3
"""hf_chat_data.py: chat and instruction data, from JSONL to gradients, against transformers.

Runs under the environment deploy/hf-venv.sh makes. A tokenizer is trained here (byte-level BPE
through `tokenizers`, with ChatML's special tokens and chat template) and saved with a small
random Qwen2-shaped model (q, k, v biases; weights with std 0.1) in one directory. Datasets in
the three shapes (messages, prompt-completion as strings and as messages, text; JSONL and
parquet) go through `strata data prepare`. Then:

  1. Tokens: every document's ids are transformers' own (apply_chat_template(tokenize=True),
     the tokenizer on prompt and completion, on text, with EOS where `strata data prepare`
     appends it), and the trained tokens decode to exactly the assistant turns (each turn's
     content and its end-of-turn marker) or the completion: nothing of a prompt is trained.
  2. Bad rows: an error naming the file and line; --skip-bad counts them and writes the rest;
     nothing is left behind by a failed run; a model directory without a tokenizer is refused.
  3. Evaluation: `strata eval` of the prepared conversations, packed (with documents longer than
     a sequence split into pieces) and one per sequence, on 1 and 2 ranks, equals transformers'
     loss of every document (piece) alone, summed over the trained tokens and divided by their
     number (relative 1e-5).
  4. Training: one AdamW step with betas (0, 0) (its saved first moment is the gradient) on
     micro-batches that hold different numbers of trained tokens, 1 rank x 2 accumulation and
     2 ranks (ZeRO-3): the reported loss and every gradient equal transformers' on the same
     global batch with the loss averaged over its trained tokens (relative 1e-5 and 1e-4).
  5. A checkpoint carries the tokenizer and chat template, and `strata train` refuses prepared
     data whose tokenizer hash is not the model's.

Usage: hf_chat_data.py --strata BIN --work DIR [--mpiexec MPIEXEC]. Exit 0 when every check
holds, 1 otherwise (each failure printed).
"""
import argparse
import json
import os
import random
import shutil
import struct
import subprocess
import sys

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config

SEQ = 64
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
WORDS = ("the a an list sort reverse numbers words answer question please give me of and to "
         "in is it this that what which one two three four five six seven eight nine ten").split()
FAILURES = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        FAILURES.append(what)


def run(cmd, ok=True):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if ok and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stdout[-3000:]}\n"
                           f"{r.stderr[-3000:]}")
    return r


def sentence(rng, lo, hi):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def make_model_dir(path):
    rng = random.Random(0)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[
        "<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([sentence(rng, 3, 12) for _ in range(2000)], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(path)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(fast), hidden_size=64, intermediate_size=96,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.1,
                      tie_word_embeddings=False, eos_token_id=fast.eos_token_id,
                      pad_token_id=fast.pad_token_id, bos_token_id=None,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def conversation(rng):
    msgs = []
    if rng.random() < 0.5:
        msgs.append({"role": "system", "content": sentence(rng, 2, 6)})
    for _ in range(rng.randint(1, 3)):
        msgs.append({"role": "user", "content": sentence(rng, 1, 10)})
        msgs.append({"role": "assistant", "content": sentence(rng, 1, 14)})
    return msgs


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def read_prepared(path):
    b = open(path, "rb").read()
    assert b[:8] == b"STRATATK", path
    _, hl = struct.unpack("<II", b[8:16])
    h = json.loads(b[16:16 + hl])
    s = h["sections"]
    ids = np.frombuffer(b, "<u4", h["tokens"], s["tokens"]["offset"]).astype(np.int64)
    mask = np.frombuffer(b, "u1", h["tokens"], s["loss_mask"]["offset"])
    offs = np.frombuffer(b, "<u8", h["documents"] + 1, s["doc_offsets"]["offset"])
    docs = [(ids[offs[d]:offs[d + 1]], mask[offs[d]:offs[d + 1]]) for d in range(h["documents"])]
    return h, docs


def prepare(args, model_dir, inputs, out, *extra, ok=True):
    cmd = [args.strata, "data", "prepare", "--model", model_dir, "--out", out, "--workers", "2"]
    for i in inputs:
        cmd += ["--input", i]
    return run(cmd + list(extra), ok=ok)


def pack(docs, seq, packed=True):
    """The rows train/packing.h makes: lists of (ids, mask) pieces."""
    cap = seq + 1
    pieces = []
    for ids, mask in docs:
        start = 0
        if len(ids) > cap:
            while len(ids) - start > cap:
                pieces.append((ids[start:start + cap], mask[start:start + cap]))
                start += seq
            if len(ids) - start < 2:
                continue
        pieces.append((ids[start:], mask[start:]))
    rows, row, used = [], [], 0
    for p in pieces:
        if row and (not packed or used + len(p[0]) > cap):
            rows.append(row)
            row, used = [], 0
        row.append(p)
        used += len(p[0])
        if used == cap:
            rows.append(row)
            row, used = [], 0
    if row:
        rows.append(row)
    return rows


def piece_loss_sum(model, ids, mask):
    """Sum of cross-entropies of the piece's trained targets, and their number."""
    x = torch.as_tensor(ids, dtype=torch.long)[None]
    logits = model(input_ids=x[:, :-1]).logits.float()[0]
    trained = torch.as_tensor(mask[1:].astype(bool))
    if trained.sum() == 0:
        return logits.sum() * 0.0, 0
    ce = F.cross_entropy(logits[trained], x[0, 1:][trained], reduction="sum")
    return ce, int(trained.sum())


def rows_loss(model, rows):
    total, n = None, 0
    for row in rows:
        for ids, mask in row:
            s, k = piece_loss_sum(model, ids, mask)
            total = s if total is None else total + s
            n += k
    return total / n, n


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--strata", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--mpiexec", default=shutil.which("mpiexec") or "")
    args = ap.parse_args()
    work = os.path.abspath(args.work)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    model_dir = os.path.join(work, "model")
    tok = make_model_dir(model_dir)
    rng = random.Random(1)
    eos = tok.eos_token_id

    # ---- 1. tokens and masks --------------------------------------------------------------
    convs = [{"messages": conversation(rng)} for _ in range(120)]
    chat = os.path.join(work, "chat.jsonl")
    write_jsonl(chat, convs)
    chat_stk = os.path.join(work, "chat.stk")
    out = prepare(args, model_dir, [chat], chat_stk).stdout
    check("120 messages document(s)" in out, f"prepare says what it wrote: {out.strip()}")
    h, docs = read_prepared(chat_stk)
    ids_ok = mask_ok = True
    for row, (ids, mask) in zip(convs, docs):
        want = tok.apply_chat_template(row["messages"], tokenize=True, return_dict=False)
        if isinstance(want, dict):
            want = want["input_ids"]
        ids_ok &= list(ids) == list(want)
        trained = tok.decode(ids[mask == 1])
        want_text = "".join(m["content"] + "<|im_end|>\n" for m in row["messages"]
                            if m["role"] == "assistant")
        mask_ok &= trained == want_text
    check(ids_ok, "messages: every document's ids are apply_chat_template's")
    check(mask_ok, "messages: the trained tokens are exactly the assistant turns")
    check(len(docs) == 120 and h["documents"] == 120, "messages: one document per row")

    pcs = [{"prompt": sentence(rng, 1, 8), "completion": " " + sentence(rng, 1, 8)}
           for _ in range(30)]
    pc = os.path.join(work, "pc.jsonl")
    write_jsonl(pc, pcs)
    _, pdocs = read_prepared_after(args, model_dir, pc, os.path.join(work, "pc.stk"))
    ok_ids = ok_mask = True
    for row, (ids, mask) in zip(pcs, pdocs):
        p = tok(row["prompt"], add_special_tokens=False)["input_ids"]
        c = tok(row["completion"], add_special_tokens=False)["input_ids"] + [eos]
        ok_ids &= list(ids) == p + c
        ok_mask &= list(mask) == [0] * len(p) + [1] * len(c)
    check(ok_ids and ok_mask, "prompt-completion strings: prompt + completion + EOS, the "
          "completion trained")

    cpcs = []
    for _ in range(20):
        m = conversation(rng)
        cpcs.append({"prompt": m[:-1], "completion": m[-1:]})
    cpc = os.path.join(work, "cpc.jsonl")
    write_jsonl(cpc, cpcs)
    _, cdocs = read_prepared_after(args, model_dir, cpc, os.path.join(work, "cpc.stk"))
    ok = True
    for row, (ids, mask) in zip(cpcs, cdocs):
        want = tok.apply_chat_template(row["prompt"] + row["completion"], tokenize=True,
                                       return_dict=False)
        ok &= list(ids) == list(want)
        ok &= tok.decode(ids[mask == 1]) == row["completion"][0]["content"] + "<|im_end|>\n"
    check(ok, "conversational prompt-completion: only the completion's assistant turn trained")

    texts = [{"text": sentence(rng, 3, 20)} for _ in range(20)]
    tx = os.path.join(work, "text.jsonl")
    write_jsonl(tx, texts)
    _, tdocs = read_prepared_after(args, model_dir, tx, os.path.join(work, "text.stk"))
    check(all(list(ids) == tok(r["text"], add_special_tokens=False)["input_ids"] + [eos]
              and mask.all() for r, (ids, mask) in zip(texts, tdocs)),
          "text: the tokenizer's ids + EOS, every token trained")

    import pyarrow as pa
    import pyarrow.parquet as pq
    parquet = os.path.join(work, "chat.parquet")
    pq.write_table(pa.Table.from_pylist(convs), parquet)
    parquet_stk = os.path.join(work, "chat-parquet.stk")
    prepare(args, model_dir, [parquet], parquet_stk)
    _, qdocs = read_prepared(parquet_stk)
    check(all((a[0] == b[0]).all() and (a[1] == b[1]).all() for a, b in zip(docs, qdocs))
          and len(qdocs) == len(docs), "parquet: the same documents as the JSONL")

    # ---- 2. bad rows -----------------------------------------------------------------------
    bad = os.path.join(work, "bad.jsonl")
    with open(bad, "w") as f:
        f.write(json.dumps(convs[0]) + "\n")
        f.write("{not json\n")
        f.write(json.dumps({"messages": [{"role": "wizard", "content": "x"}]}) + "\n")
        f.write(json.dumps(convs[1]) + "\n")
    bad_out = os.path.join(work, "bad.stk")
    r = prepare(args, model_dir, [bad], bad_out, ok=False)
    check(r.returncode != 0 and f"{bad}:2" in r.stderr and not os.path.exists(bad_out)
          and not any(n.startswith("bad.stk") for n in os.listdir(work)),
          f"a bad row stops prepare, naming {bad}:2, leaving nothing: {r.stderr.strip()[-200:]}")
    r = prepare(args, model_dir, [bad], bad_out, "--skip-bad", ok=False)
    _, kept = read_prepared(bad_out) if r.returncode == 0 else (None, [])
    check(r.returncode == 0 and len(kept) == 2 and "2 bad row(s) skipped" in r.stdout
          and "wizard" in r.stderr, f"--skip-bad keeps 2 rows and reports 2: {r.stdout.strip()}")
    empty_dir = os.path.join(work, "no-tokenizer")
    os.makedirs(empty_dir)
    r = prepare(args, empty_dir, [chat], os.path.join(work, "x.stk"), ok=False)
    check(r.returncode == 2 and "no tokenizer.json" in r.stderr,
          f"a model directory without a tokenizer is refused: {r.stderr.strip()}")

    # ---- 3. evaluation against transformers, packed and not, 1 and 2 ranks ---------------
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    mpi = [args.mpiexec, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np",
           "2"] if args.mpiexec else None
    long_docs = sum(1 for ids, _ in docs if len(ids) > SEQ + 1)
    check(long_docs > 0, f"{long_docs} conversations are longer than a sequence (split)")
    for packed in (True, False):
        rows = pack(docs, SEQ, packed)
        with torch.no_grad():
            for ranks in (1, 2):
                if ranks == 2 and not mpi:
                    print("skip 2-rank evaluation: no mpiexec")
                    continue
                used = len(rows) // ranks * ranks
                want, n = rows_loss(model, rows[:used])
                res = os.path.join(work, f"eval-{packed}-{ranks}.json")
                cmd = [args.strata, "eval", "--model", model_dir, "--data", chat_stk,
                       "--seq-len", str(SEQ), "--device", "cpu", "--json", res]
                if not packed:
                    cmd.append("--no-packing")
                run((mpi if ranks == 2 else []) + cmd)
                got = json.load(open(res))
                check(rel(got["loss"], want.item()) < 1e-5 and got["targets"] == n,
                      f"eval {'packed' if packed else 'one per row'} on {ranks} rank(s): "
                      f"{got['loss']:.7f} vs transformers {want.item():.7f} over {n} targets "
                      f"({len(rows)} rows)")

    # ---- 4. one training step: loss and gradients, uneven micro-batches --------------------
    rows = pack(docs, SEQ, True)
    global_rows = rows[:4]
    counts = [sum(int(m[1:].sum()) for _, m in row) for row in global_rows]
    check(len(set(counts)) > 1, f"the step's rows train different numbers of tokens: {counts}")
    model.zero_grad()
    want, n = rows_loss(model, global_rows)
    want.backward()
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    layouts = [("1 rank x 2 accumulation", 1, 2, 3), ("2 ranks, ZeRO-3", 2, 1, 3),
               ("1 rank, stage 0, micro-batch 4", 1, 1, 0)]
    for name, ranks, gas, stage in layouts:
        if ranks == 2 and not mpi:
            print(f"skip {name}: no mpiexec")
            continue
        micro = 4 // (ranks * gas)
        cfg = os.path.join(work, f"ds-{ranks}-{gas}.json")
        json.dump({"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
                   "optimizer": {"type": "AdamW", "params": {
                       "lr": 1e-3, "betas": [0.0, 0.0], "eps": 1e-8, "weight_decay": 0.0}},
                   "zero_optimization": {"stage": stage}}, open(cfg, "w"))
        save = os.path.join(work, f"ckpt-{ranks}-{gas}")
        metrics = os.path.join(work, f"metrics-{ranks}-{gas}.jsonl")
        cmd = [args.strata, "train", "--config", cfg, "--model", model_dir, "--data", chat_stk,
               "--seq-len", str(SEQ), "--steps", "1", "--sampling", "sequential",
               "--device", "cpu", "--save", save, "--metrics", metrics]
        run((mpi if ranks == 2 else []) + cmd)
        loss = json.loads(open(metrics).readline())["loss"]
        moments = load_file(os.path.join(save, "latest", "optimizer.safetensors"))
        worst = max(float((moments["exp_avg." + k] - g).norm() / max(g.norm(), 1e-30))
                    for k, g in grads.items())
        check(rel(loss, want.item()) < 1e-5 and worst < 1e-4,
              f"train step, {name}: loss {loss:.7f} vs {want.item():.7f}, worst gradient "
              f"{worst:.2e}")

    # ---- 5. the checkpoint carries the tokenizer; a foreign tokenizer is refused -----------
    step = os.path.join(work, "ckpt-1-2", "latest")
    have = all(os.path.exists(os.path.join(step, f))
               for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"))
    t2 = AutoTokenizer.from_pretrained(step) if have else None
    check(have and t2.apply_chat_template(convs[0]["messages"], tokenize=False) ==
          tok.apply_chat_template(convs[0]["messages"], tokenize=False),
          "the checkpoint holds the tokenizer and chat template, and they load")
    other = os.path.join(work, "other-model")
    shutil.copytree(model_dir, other)
    with open(os.path.join(other, "chat_template.jinja"), "a") as f:
        f.write("\n")
    r = run([args.strata, "train", "--config", os.path.join(work, "ds-1-2.json"), "--model",
             other, "--data", chat_stk, "--seq-len", str(SEQ), "--steps", "1", "--device",
             "cpu"], ok=False)
    check(r.returncode != 0 and "prepared with a tokenizer whose hash" in r.stderr,
          f"another tokenizer is refused: {r.stderr.strip()[-300:]}")

    if FAILURES:
        print(f"{len(FAILURES)} check(s) failed", file=sys.stderr)
        return 1
    print("all checks hold")
    return 0


def read_prepared_after(args, model_dir, src, out):
    prepare(args, model_dir, [src], out)
    return read_prepared(out)


if __name__ == "__main__":
    sys.exit(main())
