#!/usr/bin/python3
"""PyTorch reference of a short `strata train` run: the loss curve of plain AdamW, single process.

Usage:
  llama_train_ref.py prepare   WORK [--steps N]
  llama_train_ref.py reference WORK [--out FILE] [--dtype float32|float64]
  llama_train_ref.py selftest  WORK

prepare writes, under WORK:
  model/config.json        a tiny Llama (vocab 256, hidden 64, intermediate 128, 2 layers, 4 heads,
                           2 kv heads, untied LM head), torch_dtype float32
  model/model.safetensors  deterministic random fp32 weights under Hugging Face's names (the
                           safetensors format written here by hand: no external package)
  tokens.bin               raw uint16 tokens of a learnable pattern (a sparse Markov chain)
  ds_config.json           DeepSpeed config: ZeRO stage 3, parameters and optimizer on NVMe
                           (WORK/nvme), fp32, AdamW, constant LR, gradient clipping 1.0,
                           2 sequences per rank per micro-step, 2 accumulation steps
  setup.json               what the run needs: seq_len, steps, world size, batch layout, paths

reference trains the model of WORK/model on WORK/tokens.bin with torch.optim.AdamW (the same
hyper-parameters, the same global-norm clipping as torch.nn.utils.clip_grad_norm_) for the steps
of setup.json, in one process, and writes {"losses": [...]} (the loss of step s is the mean
cross-entropy over step s's global batch, before step s's update) to --out (default
WORK/ref_losses.json).

Data order (src/train/data.h): with sequence length T, window w is tokens [w*T, w*T + T + 1);
there are W = floor((N - 1) / T) windows. A step takes a global batch of
G = world_size * micro_batch * grad_accum windows; sequential sampling visits windows 0..W-1 in
every epoch, an epoch holds floor(W / G) steps (the leftover positions are skipped), so step s is
windows p .. p + G - 1 with p = (s mod floor(W / G)) * G. Which rank and micro-step holds which
row does not change the mean loss or the averaged gradient (all rows have T targets), so the
reference runs the whole global batch at once.

selftest checks the reference's forward against tests/oracle/llama_ref.py (float64) on the
prepared weights and the first global batch.

Written for Strata; needs only torch and numpy (Debian's python3-torch).
"""
import argparse
import fnmatch
import json
import math
import os
import struct
import subprocess
import sys

import numpy as np
import torch
import torch.nn.functional as F

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}

SEQ_LEN = 32
WORLD_SIZE = 2
MICRO_BATCH = 2
GRAD_ACCUM = 2
LR = 1e-3
BETAS = (0.9, 0.95)
EPS = 1e-8
WEIGHT_DECAY = 0.1
CLIP = 1.0
# 85 windows: 10 steps of G = 8 per epoch (5 windows skipped at each epoch's end), so 20 steps
# cover two epochs; 7 more tokens after the last window are never used.
NUM_WINDOWS = 85
EXTRA_TOKENS = 7


def param_shapes(cfg):
    """Hugging Face names and shapes, in Strata's unit order (src/model/llama_model.h)."""
    h, v, i = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    kv = h // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    out = [("model.embed_tokens.weight", [v, h])]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        out += [
            (p + "input_layernorm.weight", [h]),
            (p + "self_attn.q_proj.weight", [h, h]),
            (p + "self_attn.k_proj.weight", [kv, h]),
            (p + "self_attn.v_proj.weight", [kv, h]),
            (p + "self_attn.o_proj.weight", [h, h]),
            (p + "post_attention_layernorm.weight", [h]),
            (p + "mlp.gate_proj.weight", [i, h]),
            (p + "mlp.up_proj.weight", [i, h]),
            (p + "mlp.down_proj.weight", [h, i]),
        ]
    out += [("model.norm.weight", [h]), ("lm_head.weight", [v, h])]
    return out


PROJECTIONS = [("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"),
               ("self_attn", "o_proj"), ("mlp", "gate_proj"), ("mlp", "up_proj"),
               ("mlp", "down_proj")]


def lora_settings(ds):
    """strata.lora of a DeepSpeed config as (r, scale, targets), or None."""
    lora = ds.get("strata", {}).get("lora")
    if not lora or not lora.get("r"):
        return None
    targets = lora.get("target_modules") or ["q_proj", "v_proj"]
    if isinstance(targets, str):
        targets = [targets]
    if "all-linear" in targets:
        targets = [m for _, m in PROJECTIONS]
    return lora["r"], lora.get("lora_alpha", 8) / lora["r"], set(targets)


def adapter_shapes(cfg, r, targets):
    """LoRA adapter names (Strata's, without PEFT's "base_model.model." prefix) and shapes."""
    shapes = dict(param_shapes(cfg))
    out = []
    for layer in range(cfg["num_hidden_layers"]):
        for block, mod in PROJECTIONS:
            if mod not in targets:
                continue
            prefix = f"model.layers.{layer}.{block}.{mod}"
            o, i = shapes[prefix + ".weight"]
            out += [(prefix + ".lora_A.weight", [r, i]), (prefix + ".lora_B.weight", [o, r])]
    return out


def prepare_adapter(adapter_dir, cfg, r, alpha, targets, seed):
    """A PEFT adapter directory with random A and B (B non-zero, unlike PEFT's init, so that
    both matrices get gradients from the first step)."""
    os.makedirs(adapter_dir, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = []
    for name, shape in adapter_shapes(cfg, r, targets):
        t = 0.05 * torch.randn(shape, generator=gen, dtype=torch.float64)
        tensors.append(("base_model.model." + name, t.to(torch.float32).numpy()))
    write_safetensors(os.path.join(adapter_dir, "adapter_model.safetensors"), tensors)
    with open(os.path.join(adapter_dir, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha,
                   "lora_dropout": 0.0, "target_modules": sorted(targets), "bias": "none"}, f,
                  indent=2)


# ---- safetensors (F32 only), written and read by hand -------------------------------------------

def write_safetensors(path, tensors):
    """tensors: list of (name, float32 numpy array), stored in that order."""
    header = {"__metadata__": {"format": "pt"}}
    offset = 0
    blobs = []
    for name, array in tensors:
        data = np.ascontiguousarray(array, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)  # data section 8-byte aligned
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for data in blobs:
            f.write(data)
    os.replace(tmp, path)


def read_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    base = 8 + n
    out = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        if spec["dtype"] != "F32":
            raise ValueError(f"{path}: {name}: only F32 is read here, not {spec['dtype']}")
        begin, end = spec["data_offsets"]
        out[name] = np.frombuffer(raw[base + begin:base + end], dtype="<f4").reshape(spec["shape"])
    return out


# ---- prepare ----------------------------------------------------------------------------------

def markov_tokens(vocab, count, seed):
    """A learnable stream: each token has 4 successors (probabilities .5/.25/.15/.1), 5% noise."""
    rng = np.random.Generator(np.random.PCG64(seed))
    successors = rng.integers(0, vocab, size=(vocab, 4))
    probs = np.array([0.5, 0.25, 0.15, 0.10])
    choice = rng.choice(4, size=count, p=probs)
    noise = rng.random(count) < 0.05
    uniform = rng.integers(0, vocab, size=count)
    out = np.empty(count, dtype=np.uint16)
    t = int(rng.integers(0, vocab))
    for k in range(count):
        out[k] = t
        t = int(uniform[k]) if noise[k] else int(successors[t, choice[k]])
    return out


def initial_weights(cfg, seed):
    """Hugging Face's init (N(0, 0.02)) with norm weights 1 + N(0, 0.1), so that loading the norms
    matters too."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for name, shape in param_shapes(cfg):
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen, dtype=torch.float64)
        else:
            t = 0.02 * torch.randn(shape, generator=gen, dtype=torch.float64)
        out.append((name, t.to(torch.float32).numpy()))
    return out


def prepare(work, steps):
    work = os.path.abspath(work)
    model_dir = os.path.join(work, "model")
    nvme = os.path.join(work, "nvme")
    os.makedirs(model_dir, exist_ok=True)
    os.makedirs(nvme, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(CONFIG, f, indent=2)
    write_safetensors(os.path.join(model_dir, "model.safetensors"), initial_weights(CONFIG, 2024))

    num_tokens = NUM_WINDOWS * SEQ_LEN + 1 + EXTRA_TOKENS
    tokens = markov_tokens(CONFIG["vocab_size"], num_tokens, seed=7)
    tokens.astype("<u2").tofile(os.path.join(work, "tokens.bin"))

    ds = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": GRAD_ACCUM,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                  "weight_decay": WEIGHT_DECAY}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": nvme},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme},
            # Partition every unit (the default keeps units under 100k elements gathered).
            "stage3_param_persistence_threshold": 0,
            # Several optimizer sub-groups per unit shard.
            "sub_group_size": 8192,
        },
    }
    with open(os.path.join(work, "ds_config.json"), "w") as f:
        json.dump(ds, f, indent=2)
    setup = {
        "model": model_dir, "data": os.path.join(work, "tokens.bin"), "data_dtype": "uint16",
        "config": os.path.join(work, "ds_config.json"), "seq_len": SEQ_LEN, "steps": steps,
        "world_size": WORLD_SIZE, "micro_batch": MICRO_BATCH, "grad_accum": GRAD_ACCUM,
    }
    with open(os.path.join(work, "setup.json"), "w") as f:
        json.dump(setup, f, indent=2)
    return setup


# ---- data order -------------------------------------------------------------------------------

def global_batch_windows(num_tokens, seq_len, global_batch, step):
    """Sequential sampling, a sampler created at step 0 (src/train/data.h)."""
    num_windows = (num_tokens - 1) // seq_len
    steps_per_epoch = num_windows // global_batch
    if steps_per_epoch == 0:
        raise ValueError(f"{num_windows} windows hold no global batch of {global_batch}")
    position = (step % steps_per_epoch) * global_batch
    return list(range(position, position + global_batch))


def global_batch(tokens, seq_len, global_batch_size, step):
    rows = [tokens[w * seq_len:w * seq_len + seq_len + 1]
            for w in global_batch_windows(len(tokens), seq_len, global_batch_size, step)]
    return torch.from_numpy(np.stack(rows).astype(np.int64))


# ---- the model --------------------------------------------------------------------------------

def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_tables(seq_len, head_dim, theta, dtype):
    half = head_dim // 2
    inv = 1.0 / (theta ** (torch.arange(0, half, dtype=torch.float64) * 2.0 / head_dim))
    ang = torch.arange(seq_len, dtype=torch.float64)[:, None] * inv[None, :]
    emb = torch.cat([ang, ang], -1)
    return emb.cos().to(dtype)[None, :, None, :], emb.sin().to(dtype)[None, :, None, :]


def apply_rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def forward_loss(params, cfg, tokens, lora=None):
    """Mean cross-entropy of next-token prediction over every target of `tokens` [B, T + 1].
    `lora` (r, scale, targets): the targeted projections add PEFT's scale * B(A(x))."""
    b, s = tokens.shape[0], tokens.shape[1] - 1
    h, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = h // nh
    eps = cfg["rms_norm_eps"]
    dtype = params["lm_head.weight"].dtype
    cos, sin = rope_tables(s, d, cfg["rope_theta"], dtype)
    inputs, targets = tokens[:, :s], tokens[:, 1:]
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)
    x = F.embedding(inputs, params["model.embed_tokens.weight"])
    for i in range(cfg["num_hidden_layers"]):
        g = lambda n: params[f"model.layers.{i}." + n]

        def proj(x_in, module):
            y = x_in @ g(module + ".weight").T
            if lora is not None and module.split(".")[-1] in lora[2]:
                y = y + (x_in @ g(module + ".lora_A.weight").T @ g(module + ".lora_B.weight").T) \
                    * lora[1]
            return y

        a = rms_norm(x, g("input_layernorm.weight"), eps)
        q = apply_rope(proj(a, "self_attn.q_proj").view(b, s, nh, d), cos, sin)
        k = apply_rope(proj(a, "self_attn.k_proj").view(b, s, nkv, d), cos, sin)
        v = proj(a, "self_attn.v_proj").view(b, s, nkv, d)
        k = k.repeat_interleave(nh // nkv, dim=2)
        v = v.repeat_interleave(nh // nkv, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(mask, float("-inf"))
        att = (torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(b, s, h)
        x = x + proj(att, "self_attn.o_proj")
        m = rms_norm(x, g("post_attention_layernorm.weight"), eps)
        x = x + proj(F.silu(proj(m, "mlp.gate_proj")) * proj(m, "mlp.up_proj"), "mlp.down_proj")
    x = rms_norm(x, params["model.norm.weight"], eps)
    logits = x @ params["lm_head.weight"].T
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def load_setup(work):
    with open(os.path.join(work, "setup.json")) as f:
        setup = json.load(f)
    with open(os.path.join(setup["model"], "config.json")) as f:
        cfg = json.load(f)
    tokens = np.fromfile(setup["data"], dtype="<u2")
    weights = read_safetensors(os.path.join(setup["model"], "model.safetensors"))
    return setup, cfg, tokens, weights


def reference(work, out, dtype_name):
    setup, cfg, tokens, weights = load_setup(work)
    with open(setup["config"]) as f:
        ds = json.load(f)
    dtype = {"float32": torch.float32, "float64": torch.float64}[dtype_name]
    torch.set_num_threads(1)  # deterministic reductions; the model is tiny
    params = {name: torch.nn.Parameter(torch.from_numpy(weights[name].copy()).to(dtype))
              for name, _ in param_shapes(cfg)}
    # LoRA (strata.lora): the adapters start from the run's adapter directory; the base weights
    # are frozen unless strata.trainable names them (as Strata does).
    lora = lora_settings(ds)
    if lora is not None:
        adapters = read_safetensors(os.path.join(work, "adapter", "adapter_model.safetensors"))
        for name, _ in adapter_shapes(cfg, lora[0], lora[2]):
            params[name] = torch.nn.Parameter(
                torch.from_numpy(adapters["base_model.model." + name].copy()).to(dtype))
    # Frozen parameters (Strata's strata.freeze / strata.trainable, glob patterns on these
    # names): no gradient, not in the optimizer, not in the gradient norm.
    freeze = ds.get("strata", {}).get("freeze", [])
    trainable = ds.get("strata", {}).get("trainable", [])
    for name, p in params.items():
        if lora is not None:
            p.requires_grad_(".lora_" in name or
                             any(fnmatch.fnmatchcase(name, pat) for pat in trainable))
        elif freeze:
            p.requires_grad_(not any(fnmatch.fnmatchcase(name, pat) for pat in freeze))
        elif trainable:
            p.requires_grad_(any(fnmatch.fnmatchcase(name, pat) for pat in trainable))
    trained = [p for p in params.values() if p.requires_grad]
    op = ds["optimizer"]["params"]
    opt = torch.optim.AdamW(trained, lr=op["lr"], betas=tuple(op["betas"]),
                            eps=op["eps"], weight_decay=op["weight_decay"])
    clip = float(ds.get("gradient_clipping", 0.0))
    g = setup["world_size"] * setup["micro_batch"] * setup["grad_accum"]
    losses, norms = [], []
    for step in range(setup["steps"]):
        batch = global_batch(tokens, setup["seq_len"], g, step)
        opt.zero_grad(set_to_none=True)
        loss = forward_loss(params, cfg, batch, lora)
        loss.backward()
        grads = [p.grad for p in trained]
        norm = torch.sqrt(sum((gr.double() ** 2).sum() for gr in grads)).item()
        if clip > 0:
            coef = clip / (norm + 1e-6)
            if coef < 1.0:
                for gr in grads:
                    gr.mul_(coef)
        opt.step()
        losses.append(loss.item())
        norms.append(norm)
    # The final weights, for comparison with the checkpoint Strata saved.
    write_safetensors(os.path.join(work, "ref_final.safetensors"),
                      [(name, p.detach().to(torch.float32).numpy()) for name, p in params.items()])
    result = {"dtype": dtype_name, "losses": losses, "grad_norms": norms}
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    return result


def selftest(work):
    """The reference forward equals llama_ref.py's on the prepared weights and step 0's batch,
    and the reference's fp32 loss falls."""
    setup, cfg, tokens, weights = load_setup(work)
    g = setup["world_size"] * setup["micro_batch"] * setup["grad_accum"]
    batch = global_batch(tokens, setup["seq_len"], g, 0)
    d = os.path.join(work, "selftest")
    os.makedirs(d, exist_ok=True)
    meta = {"config": cfg, "batch": int(batch.shape[0]), "seq_len": setup["seq_len"],
            "params": [{"name": n, "shape": s} for n, s in param_shapes(cfg)]}
    with open(os.path.join(d, "meta.json"), "w") as f:
        json.dump(meta, f)
    for name, _ in param_shapes(cfg):
        weights[name].astype("<f4").tofile(os.path.join(d, name + ".bin"))
    batch.numpy().astype("<i4").tofile(os.path.join(d, "tokens.bin"))
    here = os.path.dirname(os.path.abspath(__file__))
    subprocess.run([sys.executable, os.path.join(here, "llama_ref.py"), d], check=True)
    with open(os.path.join(d, "loss.txt")) as f:
        ref64 = float(f.read())
    params = {n: torch.from_numpy(weights[n].copy()).double() for n, _ in param_shapes(cfg)}
    ours64 = forward_loss(params, cfg, batch).item()
    params32 = {n: torch.from_numpy(weights[n].copy()) for n, _ in param_shapes(cfg)}
    ours32 = forward_loss(params32, cfg, batch).item()
    print(f"step-0 loss: llama_ref.py (float64) {ref64:.12f}, this script float64 {ours64:.12f}, "
          f"float32 {ours32:.9f}")
    ok = abs(ours64 - ref64) <= 1e-10 * abs(ref64) and abs(ours32 - ref64) <= 1e-5 * abs(ref64)
    run = reference(work, os.path.join(d, "losses.json"), "float32")
    losses = run["losses"]
    print("float32 losses:", " ".join(f"{x:.4f}" for x in losses))
    falls = losses[-1] < losses[0] - 0.3
    print(f"loss falls from {losses[0]:.4f} to {losses[-1]:.4f} "
          f"(ln(vocab) = {math.log(cfg['vocab_size']):.4f}): {'ok' if falls else 'NOT ENOUGH'}")
    if not ok:
        print("FAIL: the forward disagrees with llama_ref.py")
    return 0 if ok and falls else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=["prepare", "reference", "selftest"])
    ap.add_argument("work")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out")
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    args = ap.parse_args()
    if args.mode == "prepare":
        prepare(args.work, args.steps)
        return 0
    if args.mode == "reference":
        reference(args.work, args.out or os.path.join(args.work, "ref_losses.json"), args.dtype)
        return 0
    return selftest(args.work)


if __name__ == "__main__":
    sys.exit(main())
