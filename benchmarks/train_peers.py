#!/usr/bin/env python3
"""train_peers.py: the PyTorch side of benchmarks/gpu_train_bench.py.

Trains the Llama decoder Strata trains (the same shapes from a Hugging Face config.json: RMSNorm,
rotary embeddings, grouped-query causal attention, SwiGLU MLP, untied LM head, mean
cross-entropy over shifted targets) on random tokens, with AdamW, and times the steps:

  eager          the model on one GPU in PyTorch eager: fp32 parameters, bf16 autocast (with
                 --bf16), F.scaled_dot_product_attention (an explicit masked softmax on a
                 torch older than 2.0), torch.optim.AdamW(fused=True); what a
                 PyTorch user runs with the model and optimizer in HBM.
  fsdp2-offload  the same model wrapped per block and at the root with FSDP2 (fully_shard) and
                 CPUOffloadPolicy on one rank: parameters and gradients live in pinned host
                 memory, the AdamW step runs on the CPU (torch.optim.AdamW, foreach), bf16 compute
                 through MixedPrecisionPolicy (with --bf16).
  deepspeed-offload   DeepSpeed (the version importable by this python) ZeRO-3 on one rank with
                 offload_optimizer "cpu": ZeRO-Offload, its AdamW on the CPU (DeepSpeedCPUAdam,
                 whose op DeepSpeed JIT-builds on first use), bf16 through its "bf16" section.
  deepspeed-infinity  ZeRO-3 with offload_param and offload_optimizer on NVMe (--nvme-dir):
                 ZeRO-Infinity, its async_io op (libaio) JIT-built; --aio sets its "aio" section.

Timing: torch.cuda.synchronize() around each step (forward, backward, optimizer step,
zero_grad), the host clock; the first --warmup steps are left out; step_s is the median of the
rest. tokens_per_s = micro_batch * seq_len / step_s.

Output: one JSON object on stdout: {"impl": "pytorch" or "deepspeed", "mode", "device", "torch",
("deepspeed", "ds_config" for DeepSpeed's), "parameters",
"seq_len", "micro_batch", "steps", "step_s", "step_s_all", "tokens_per_s", "peak_device_bytes",
"losses"}. Exit status 0 on success; 2 when torch (or the mode) cannot run here, with one line on
stderr saying why; 1 when a step fails.

Standalone: the standard library and torch only (and deepspeed for its modes).
"""

import argparse
import json
import math
import os
import statistics
import sys
import time

SKIP = 2


def log(msg):
    print("train_peers: " + msg, file=sys.stderr, flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode",
                    choices=["eager", "fsdp2-offload", "deepspeed-offload", "deepspeed-infinity"])
    ap.add_argument("--config", required=True, help="a Hugging Face Llama config.json")
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--micro-batch", type=int, required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--bf16", action="store_true", help="bf16 compute (autocast / mixed precision)")
    ap.add_argument("--checkpoint", action="store_true",
                    help="activation checkpointing per block (Strata always checkpoints)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--nvme-dir", default=None,
                    help="deepspeed-infinity: the directory DeepSpeed swaps to")
    ap.add_argument("--aio", default=None,
                    help="deepspeed-infinity: DeepSpeed's \"aio\" section as JSON (block_size, "
                         "queue_depth, thread_count, ...; default: DeepSpeed's own)")
    args = ap.parse_args()
    if args.steps <= args.warmup:
        ap.error("--steps must exceed --warmup")
    deepspeed_mode = args.mode.startswith("deepspeed")
    if args.mode == "deepspeed-infinity" and not args.nvme_dir:
        ap.error("deepspeed-infinity needs --nvme-dir")

    try:
        import torch
        import torch.nn as nn
        import torch.nn.functional as F
        from torch.utils.checkpoint import checkpoint
    except ImportError as e:
        log(f"{sys.executable} cannot import torch ({e})")
        return SKIP
    if args.device == "cuda" and not torch.cuda.is_available():
        log("torch sees no CUDA device")
        return SKIP
    dev = torch.device(args.device)

    with open(args.config) as f:
        cfg = json.load(f)
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    nh = cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads", nh)
    d = h // nh
    vocab, layers = cfg["vocab_size"], cfg["num_hidden_layers"]
    eps, theta = cfg.get("rms_norm_eps", 1e-5), cfg.get("rope_theta", 10000.0)
    s, b = args.seq_len, args.micro_batch

    class RMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(h))

        def forward(self, x):
            xf = x.float()
            y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
            return (y * self.weight.float()).to(x.dtype)

    half = d // 2
    inv = theta ** (-torch.arange(0, half, dtype=torch.float64) * 2.0 / d)
    ang = torch.arange(s, dtype=torch.float64)[:, None] * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1).float().to(dev)[None, None]
    sin = torch.cat([ang.sin(), ang.sin()], -1).float().to(dev)[None, None]

    def rope(x):  # [B, heads, S, d]
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return (x.float() * cos + rotated.float() * sin).to(x.dtype)

    sdpa = getattr(F, "scaled_dot_product_attention", None)
    causal = torch.full((s, s), float("-inf"), device=dev).triu(1)

    def attention(q, k, v):  # [B, heads, S, d]
        if sdpa is not None:  # torch >= 2.0: flash / memory-efficient kernels
            return sdpa(q, k, v, is_causal=True)
        scores = (q @ k.transpose(-1, -2)).float() / math.sqrt(d) + causal
        return (torch.softmax(scores, -1).to(v.dtype) @ v)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.input_layernorm = RMSNorm()
            self.q_proj = nn.Linear(h, h, bias=False)
            self.k_proj = nn.Linear(h, nkv * d, bias=False)
            self.v_proj = nn.Linear(h, nkv * d, bias=False)
            self.o_proj = nn.Linear(h, h, bias=False)
            self.post_attention_layernorm = RMSNorm()
            self.gate_proj = nn.Linear(h, inter, bias=False)
            self.up_proj = nn.Linear(h, inter, bias=False)
            self.down_proj = nn.Linear(inter, h, bias=False)

        def forward(self, x):
            a = self.input_layernorm(x)
            q = self.q_proj(a).view(b, s, nh, d).transpose(1, 2)
            k = self.k_proj(a).view(b, s, nkv, d).transpose(1, 2)
            v = self.v_proj(a).view(b, s, nkv, d).transpose(1, 2)
            q, k = rope(q), rope(k)
            if nkv != nh:
                k = k.repeat_interleave(nh // nkv, dim=1)
                v = v.repeat_interleave(nh // nkv, dim=1)
            att = attention(q, k, v)
            x = x + self.o_proj(att.transpose(1, 2).reshape(b, s, h))
            m = self.post_attention_layernorm(x)
            return x + self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m))

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(vocab, h)
            self.layers = nn.ModuleList(Block() for _ in range(layers))
            self.norm = RMSNorm()
            self.lm_head = nn.Linear(h, vocab, bias=False)

        def forward(self, tokens):
            x = self.embed_tokens(tokens)
            for layer in self.layers:
                x = checkpoint(layer, x, use_reentrant=False) if args.checkpoint else layer(x)
            logits = self.lm_head(self.norm(x)).float()
            return logits

    torch.manual_seed(0)
    home = dev if args.mode in ("eager", "deepspeed-offload", "deepspeed-infinity") \
        else torch.device("cpu")
    try:
        with torch.device("meta"):  # no init work for weights overwritten below
            model = Llama()
        model = model.to_empty(device=home)
    except (TypeError, AttributeError):  # a torch older than 2.0
        model = Llama().to(home)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    params = sum(p.numel() for p in model.parameters())

    amp = torch.autocast(device_type=args.device, dtype=torch.bfloat16, enabled=args.bf16)
    engine, ds_version, zero = None, None, None
    if deepspeed_mode:
        if args.device != "cuda":
            # A smoke run of the code path on DeepSpeed's CPU accelerator (gloo); not a peer
            # figure.
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        try:
            import deepspeed
        except ImportError as e:
            log(f"{sys.executable} cannot import deepspeed ({e})")
            return SKIP
        ds_version = deepspeed.__version__
        for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29534"), ("RANK", "0"),
                           ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
            os.environ.setdefault(key, value)
        if args.device == "cuda":
            torch.cuda.set_device(0)
        deepspeed.init_distributed(dist_backend="nccl" if args.device == "cuda" else "gloo",
                                   verbose=False)
        if args.mode == "deepspeed-offload":
            zero = {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
        else:
            nvme = {"device": "nvme", "nvme_path": args.nvme_dir, "pin_memory": True}
            zero = {"stage": 3, "offload_param": dict(nvme), "offload_optimizer": dict(nvme)}
        zero.update({"overlap_comm": True, "contiguous_gradients": True})
        ds_config = {
            "train_micro_batch_size_per_gpu": b,
            "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.999],
                                                      "eps": 1e-8, "weight_decay": 0.0}},
            "zero_optimization": zero,
            "bf16": {"enabled": args.bf16},
            "steps_per_print": 1 << 30,
        }
        if args.aio:
            ds_config["aio"] = json.loads(args.aio)
        try:
            engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=ds_config)
        except Exception as e:  # an op that does not build, a config it refuses: say which
            log(f"{args.mode}: deepspeed.initialize failed: {type(e).__name__}: {e}")
            return 1
        amp = torch.autocast(device_type=args.device, enabled=False)  # DeepSpeed's bf16 casts
    elif args.mode == "eager":
        extra = {"fused": True} if args.device == "cuda" else {}
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8,
                                weight_decay=0.0, **extra)
    else:
        if args.device != "cuda":
            log("fsdp2-offload needs a CUDA device (CPUOffloadPolicy moves shards to the GPU)")
            return SKIP
        try:
            from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy,
                                                fully_shard)
        except ImportError:
            try:
                from torch.distributed._composable.fsdp import (CPUOffloadPolicy,
                                                                MixedPrecisionPolicy,
                                                                fully_shard)
            except ImportError as e:
                log(f"this torch ({torch.__version__}) has no FSDP2 ({e})")
                return SKIP
        import torch.distributed as dist
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl", rank=0, world_size=1)
        torch.cuda.set_device(0)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if args.bf16 else torch.float32,
                                  reduce_dtype=torch.float32)
        for layer in model.layers:
            fully_shard(layer, offload_policy=CPUOffloadPolicy(), mp_policy=mp)
        fully_shard(model, offload_policy=CPUOffloadPolicy(), mp_policy=mp)
        amp = torch.autocast(device_type="cuda", enabled=False)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8,
                                weight_decay=0.0)

    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (args.steps, b, s + 1), generator=gen).to(dev)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    try:
        for step in range(args.steps):
            sync()
            t0 = time.perf_counter()
            batch = tokens[step]
            with amp:
                logits = (engine or model)(batch[:, :s])
            loss = F.cross_entropy(logits.float().reshape(-1, vocab), batch[:, 1:].reshape(-1))
            if engine is not None:
                engine.backward(loss)
                engine.step()
            else:
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            sync()
            times.append(time.perf_counter() - t0)
            losses.append(float(loss.detach()))
            log(f"{args.mode} step {step + 1}: {times[-1]:.3f} s, loss {losses[-1]:.4f}")
    except RuntimeError as e:
        log(f"{args.mode}: a step failed: {e}")
        return 1
    step_s = statistics.median(times[args.warmup:])
    out = {
        "impl": "deepspeed" if deepspeed_mode else "pytorch",
        "mode": args.mode,
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "parameters": params,
        "seq_len": s,
        "micro_batch": b,
        "bf16": args.bf16,
        "checkpoint": args.checkpoint,
        "steps": args.steps,
        "warmup": args.warmup,
        "step_s": step_s,
        "step_s_all": times,
        "tokens_per_s": b * s / step_s,
        "peak_device_bytes": torch.cuda.max_memory_allocated() if args.device == "cuda" else 0,
        "losses": losses,
        "finite": all(math.isfinite(x) for x in losses),
    }
    if deepspeed_mode:
        out["deepspeed"] = ds_version
        out["ds_config"] = {"zero_optimization": zero, "aio": ds_config.get("aio", "defaults")}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
