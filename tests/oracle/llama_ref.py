#!/usr/bin/python3
"""PyTorch reference of Strata's Llama decoder, for tests/model/llama_model_test.cc.

Usage: /usr/bin/python3 llama_ref.py DIR

DIR holds meta.json (the model config, batch, seq_len and every parameter's name and shape, in
unit order), one raw little-endian float32 file per parameter (<name>.bin), and tokens.bin
(int32, batch * (seq_len + 1)). The script runs one forward and backward in float64 with the
Hugging Face Llama arithmetic (RMSNorm, rotary embeddings with rotate_half, grouped-query causal
attention, SwiGLU MLP, untied LM head, mean cross-entropy over the shifted targets) and writes
loss.txt and grad.<name>.bin (float64) into DIR.

Written for Strata; needs only torch (Debian's python3-torch).
"""
import json
import math
import os
import sys

import torch
import torch.nn.functional as F


def load(path, dtype, shape):
    with open(path, "rb") as f:
        data = bytearray(f.read())
    return torch.frombuffer(data, dtype=dtype).reshape(shape).clone()


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, theta):
    # x: [B, S, heads, d]
    _, s, _, d = x.shape
    half = d // 2
    inv = theta ** (-torch.arange(0, half, dtype=torch.float64) * 2.0 / d)
    ang = torch.arange(s, dtype=torch.float64)[:, None] * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[None, :, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[None, :, None, :]
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def main():
    root = sys.argv[1]
    with open(os.path.join(root, "meta.json")) as f:
        meta = json.load(f)
    cfg = meta["config"]
    b, s = meta["batch"], meta["seq_len"]
    h, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = h // nh
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    params = {}
    for p in meta["params"]:
        t = load(os.path.join(root, p["name"] + ".bin"), torch.float32, p["shape"]).double()
        params[p["name"]] = t.requires_grad_(True)
    tokens = load(os.path.join(root, "tokens.bin"), torch.int32, [b, s + 1]).long()
    inputs, targets = tokens[:, :s], tokens[:, 1:]

    x = F.embedding(inputs, params["model.embed_tokens.weight"])
    mask = torch.full((s, s), float("-inf"), dtype=torch.float64).triu(1)
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        g = lambda n: params[pre + n]
        a = rms_norm(x, g("input_layernorm.weight"), eps)
        q = (a @ g("self_attn.q_proj.weight").T).view(b, s, nh, d)
        k = (a @ g("self_attn.k_proj.weight").T).view(b, s, nkv, d)
        v = (a @ g("self_attn.v_proj.weight").T).view(b, s, nkv, d)
        q, k = rope(q, theta), rope(k, theta)
        rep = nh // nkv
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, S, d]
        scores = q @ k.transpose(-1, -2) / math.sqrt(d) + mask
        att = torch.softmax(scores, -1) @ v
        att = att.transpose(1, 2).reshape(b, s, h)
        x = x + att @ g("self_attn.o_proj.weight").T
        m = rms_norm(x, g("post_attention_layernorm.weight"), eps)
        mlp = F.silu(m @ g("mlp.gate_proj.weight").T) * (m @ g("mlp.up_proj.weight").T)
        x = x + mlp @ g("mlp.down_proj.weight").T
    x = rms_norm(x, params["model.norm.weight"], eps)
    # Tied embeddings: the LM head is the embedding matrix (its gradient sums both uses).
    lm_head = params["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings") else params["lm_head.weight"]
    logits = x @ lm_head.T
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=-100)
    loss.backward()
    with open(os.path.join(root, "loss.txt"), "w") as f:
        f.write(repr(loss.item()) + "\n")
    for name, t in params.items():
        with open(os.path.join(root, "grad." + name + ".bin"), "wb") as f:
            f.write(t.grad.contiguous().numpy().tobytes())


if __name__ == "__main__":
    main()
