#!/usr/bin/env python3
"""skill_task.py: a small chat model, a skill to teach it, and a check of what it learned.

Used by the main job (deploy/main-job.sh) and by the skill test (tests/hf/chat_skill.py). It runs
under the environment deploy/hf-venv.sh makes (tokenizers, transformers, torch).

  skill_task.py make OUT [--hidden 128 --layers 4 --rows 20000 --held 200 --seed 0]
      Trains a byte-level BPE tokenizer with `tokenizers` (digits split one per token, ChatML's
      special tokens and chat template) and writes, under OUT:
        model/            tokenizer files and a Llama-3-style config.json (llama3 rope scaling,
                          grouped-query attention, untied embeddings; no weights: strata train
                          initializes them);
        train-TASK.jsonl  conversations ({"messages": [user, assistant]}) for TASK in reverse, sort;
        held-TASK.jsonl   prompts that never occur in the training file, for `ask`.
      A task's prompt is "TASK: 3 1 4 1" and its answer the list reversed or sorted ("1 4 1 3").

  skill_task.py ask CHECKPOINT HELD.jsonl [--show 3] [--json FILE]
      Loads CHECKPOINT with transformers' AutoModelForCausalLM and AutoTokenizer (the tokenizer
      the checkpoint carries), renders each held-out prompt with the chat template, answers it
      with greedy generate, and counts the answers that equal the expected one exactly. Prints
      the first --show prompts with their answers, then "accuracy K/N". --json writes
      {"correct": K, "total": N, "accuracy": K/N, "seconds": ...}.
"""
import argparse
import json
import os
import random
import sys
import time

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TASKS = ("reverse", "sort")


def conversation(task, xs):
    ys = xs[::-1] if task == "reverse" else sorted(xs)
    return {"messages": [{"role": "user", "content": f"{task}: " + " ".join(map(str, xs))},
                         {"role": "assistant", "content": " ".join(map(str, ys))}]}


def make(args):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    model_dir = os.path.join(args.out, "model")
    os.makedirs(model_dir, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["reverse: 1 2 3", "sort: 4 5 6", "user assistant system"] * 100,
                            trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(model_dir)
    config = LlamaConfig(
        vocab_size=len(fast), hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                         "rope_theta": 500000.0},
        tie_word_embeddings=False, eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id, bos_token_id=None)
    config.save_pretrained(model_dir)

    rng = random.Random(args.seed)

    def draw():
        return [rng.randrange(10) for _ in range(rng.randint(3, 6))]

    held = {task: [] for task in TASKS}
    seen = set()
    for task in TASKS:
        while len(held[task]) < args.held:
            xs = draw()
            if (task, tuple(xs)) not in seen:
                seen.add((task, tuple(xs)))
                held[task].append(conversation(task, xs))
    for task in TASKS:
        with open(os.path.join(args.out, f"train-{task}.jsonl"), "w") as f:
            n = 0
            while n < args.rows:
                xs = draw()
                if (task, tuple(xs)) in seen:
                    continue
                f.write(json.dumps(conversation(task, xs)) + "\n")
                n += 1
        with open(os.path.join(args.out, f"held-{task}.jsonl"), "w") as f:
            for row in held[task]:
                f.write(json.dumps(row) + "\n")
    print(f"skill_task: tokenizer ({len(fast)} tokens) and config in {model_dir}; "
          f"{args.rows} training and {args.held} held-out conversations per task "
          f"({', '.join(TASKS)}) in {args.out}")
    return 0


def ask(args):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    tok = AutoTokenizer.from_pretrained(args.checkpoint)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
    rows = [json.loads(line) for line in open(args.held)]
    prompts = [tok.apply_chat_template(r["messages"][:1], add_generation_prompt=True,
                                       tokenize=False) for r in rows]
    tok.padding_side = "left"
    correct = 0
    start = time.time()
    shown = []
    with torch.no_grad():
        for i in range(0, len(rows), args.batch):
            enc = tok(prompts[i:i + args.batch], return_tensors="pt", padding=True,
                      add_special_tokens=False)
            out = model.generate(**enc, max_new_tokens=24, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            for j, row in enumerate(rows[i:i + args.batch]):
                answer = tok.decode(out[j, enc["input_ids"].shape[1]:],
                                    skip_special_tokens=True).strip()
                expected = row["messages"][1]["content"]
                correct += answer == expected
                if len(shown) < args.show:
                    shown.append((row["messages"][0]["content"], answer, expected))
    seconds = time.time() - start
    for prompt, answer, expected in shown:
        mark = "right" if answer == expected else f"wrong, expected {expected!r}"
        print(f"  user: {prompt!r}  ->  model: {answer!r}  ({mark})")
    print(f"accuracy {correct}/{len(rows)} held-out prompts answered exactly "
          f"(greedy generate through transformers, {seconds:.1f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"correct": correct, "total": len(rows), "accuracy": correct / len(rows),
                       "seconds": seconds}, f)
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("make")
    p.add_argument("out")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--held", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("ask")
    p.add_argument("checkpoint")
    p.add_argument("held")
    p.add_argument("--show", type=int, default=3)
    p.add_argument("--batch", type=int, default=50)
    p.add_argument("--json")
    args = parser.parse_args()
    return make(args) if args.command == "make" else ask(args)


if __name__ == "__main__":
    sys.exit(main())
