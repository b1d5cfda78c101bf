#!/usr/bin/python3
"""PyTorch reference for Strata's Llama CPU kernels (src/model/cpu_ops.h).

Usage: llama_ops_ref.py <dir> <op>

<dir>/meta.json, written by tests/model/cpu_ops_test.cc, names the op, its scalar parameters and
its tensors: {"op": ..., "params": {...}, "tensors": {name: {"shape": [...], "dtype": "f32"|"i32"}}}.
Each tensor is a raw little-endian file <dir>/<name>.bin. The tensor "dy" is the upstream gradient
of the op's output.

The script recomputes the op in float64 with torch autograd and writes, as raw float64 files,
  ref_y.bin        the output
  ref_d<name>.bin  the gradient of sum(y * dy) with respect to each float input other than dy
and lists them in <dir>/ref.json ({"outputs": {name: shape}}). Exit status 0 on success.
"""

import json
import math
import os
import sys

import numpy as np
import torch


def load(directory, name, spec):
    dtype = np.float32 if spec["dtype"] == "f32" else np.int32
    data = np.fromfile(os.path.join(directory, name + ".bin"), dtype=dtype)
    return data.reshape(spec["shape"])


def embedding(t, p):
    return t["weight"][t["tokens"].long()]


def rmsnorm(t, p):
    x = t["x"]
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + p["eps"])
    return x * rstd * t["weight"]


def linear(t, p):
    return t["x"] @ t["weight"].t()


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(t, p):
    b, s, h, d = p["batch"], p["seq"], p["heads"], p["head_dim"]
    inv_freq = 1.0 / (p["theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    freqs = torch.outer(torch.arange(s, dtype=torch.float64), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos()[None, :, None, :]
    sin = emb.sin()[None, :, None, :]
    x = t["x"].reshape(b, s, h, d)
    return (x * cos + rotate_half(x) * sin).reshape(b * s, h * d)


def attention(t, p):
    b, s, nh, nkv, d = p["batch"], p["seq"], p["num_heads"], p["num_kv_heads"], p["head_dim"]
    q = t["q"].reshape(b, s, nh, d).transpose(1, 2)
    k = t["k"].reshape(b, s, nkv, d).transpose(1, 2).repeat_interleave(nh // nkv, dim=1)
    v = t["v"].reshape(b, s, nkv, d).transpose(1, 2).repeat_interleave(nh // nkv, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(mask, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v
    return out.transpose(1, 2).reshape(b * s, nh * d)


def silu_mul(t, p):
    return torch.nn.functional.silu(t["gate"]) * t["up"]


def residual(t, p):
    return t["a"] + t["b"]


def cross_entropy(t, p):
    loss = torch.nn.functional.cross_entropy(
        t["logits"], t["targets"].long(), ignore_index=p["ignore_index"], reduction="mean"
    )
    return loss.reshape(1)


OPS = {
    "embedding": embedding,
    "rmsnorm": rmsnorm,
    "linear": linear,
    "rope": rope,
    "attention": attention,
    "silu_mul": silu_mul,
    "residual": residual,
    "cross_entropy": cross_entropy,
}


def main():
    if len(sys.argv) != 3:
        print("usage: llama_ops_ref.py <dir> <op>", file=sys.stderr)
        return 2
    directory, op = sys.argv[1], sys.argv[2]
    with open(os.path.join(directory, "meta.json")) as f:
        meta = json.load(f)
    if meta["op"] != op or op not in OPS:
        print("unknown or mismatched op %r (meta says %r)" % (op, meta["op"]), file=sys.stderr)
        return 2
    params = meta.get("params", {})
    tensors = {}
    grads_of = []
    for name, spec in meta["tensors"].items():
        array = load(directory, name, spec)
        if spec["dtype"] == "f32":
            tensor = torch.from_numpy(array.astype(np.float64))
            if name != "dy":
                tensor.requires_grad_(True)
                grads_of.append(name)
        else:
            tensor = torch.from_numpy(array.astype(np.int64))
        tensors[name] = tensor
    y = OPS[op](tensors, params)
    dy = tensors["dy"].reshape(y.shape)
    grads = torch.autograd.grad(y, [tensors[n] for n in grads_of], dy, allow_unused=True)

    outputs = {"y": y.detach()}
    for name, grad in zip(grads_of, grads):
        outputs["d" + name] = torch.zeros_like(tensors[name]) if grad is None else grad
    listing = {}
    for name, value in outputs.items():
        value.detach().numpy().astype(np.float64).tofile(
            os.path.join(directory, "ref_" + name + ".bin"))
        listing[name] = list(value.shape)
    with open(os.path.join(directory, "ref.json"), "w") as f:
        json.dump({"outputs": listing}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
