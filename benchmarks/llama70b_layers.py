#!/usr/bin/python3
"""Two decoder layers of Llama-3-70B's (or Qwen2.5-72B's, --shape qwen72b) shape through the real
engine (issue 20, section 4; issue 39, section 1).

Builds a model of Llama-3-70B's layer shape (hidden 8192, 64 heads, 8 KV heads, FFN 28672) with
--layers decoder layers and the vocabulary cut to --vocab (or, with --shape 1t, of the 1T
scenario's layer: hidden 25600, 200 heads, 8 KV heads, with its FFN of 86016 cut by --ffn to what
the host holds), writes its base weights (bf16, random,
seeded) as model.safetensors, and trains it with ZeRO-3 on --ranks ranks of the CPU device,
parameters and optimizer states on NVMe (--nvme), for --steps steps:
  - --mode lora (default): LoRA adapters (r 16 on all seven projections) on the frozen base
    weights, which stream from NVMe every step; the adapters' optimizer states are on NVMe too.
  - --mode full: full AdamW on every weight.

Before it trains, `strata estimate` for the same config says what each rank and the node need;
where the node's need exceeds what this host has available the run is not started (it would
only thrash) and the report says by how much. After it trains, the measured peaks are set
beside the estimate:
  - device peak per rank (the device allocator's, --metrics device_peak_bytes, rank 0), 5% target;
  - the pinned pool: its size (the same plan) and its high-water mark;
  - the NVMe swap files' sizes (sampled while the run is alive);
  - resident memory: each rank's peak RSS against the estimate's device peak + pinned pool +
    set-up, and the node's memory in use (sampled) against the estimate's node need.
And the loss (finite, and lower after the last step than after the first) and the step time,
with the split `strata train` measures and the FLOPs a step computes.

Prints a table, and one JSON object with --json. Needs numpy (Debian's python3-numpy, which
deploy/install-deps.sh installs with python3-torch): run it with /usr/bin/python3.
"""
import argparse
import json
import math
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

SHAPE_70B = {"name": "Llama-3-70B", "hidden": 8192, "ffn": 28672, "heads": 64, "kv": 8}
# Qwen2.5-72B's layer: q, k and v with biases (model_type qwen2).
SHAPE_QWEN72B = {"name": "Qwen2.5-72B", "hidden": 8192, "ffn": 29568, "heads": 64, "kv": 8,
                 "model_type": "qwen2", "theta": 1000000.0, "eps": 1e-6}
SHAPE_1T = {"name": "llama-1t", "hidden": 25600, "ffn": 86016, "heads": 200, "kv": 8}
SHAPE_SMOKE = {"name": "small", "hidden": 512, "ffn": 1792, "heads": 8, "kv": 2}  # --smoke: the same script, small


def model_config(shape, layers, vocab):
    qwen = shape.get("model_type") == "qwen2"
    return {"architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
            "model_type": shape.get("model_type", "llama"), "vocab_size": vocab,
            "hidden_size": shape["hidden"], "intermediate_size": shape["ffn"],
            "num_hidden_layers": layers, "num_attention_heads": shape["heads"],
            "num_key_value_heads": shape["kv"], "max_position_embeddings": 8192,
            "rms_norm_eps": shape.get("eps", 1e-5), "rope_theta": shape.get("theta", 500000.0),
            "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16"}


def tensors_of(cfg):
    """(name, shape, kind) in Hugging Face's names; kind 'norm' (ones) or 'weight' (random)."""
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    out = [("model.embed_tokens.weight", (v, h), "weight")]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,), "norm"),
                (p + "self_attn.q_proj.weight", (h, h), "weight"),
                (p + "self_attn.k_proj.weight", (kv, h), "weight"),
                (p + "self_attn.v_proj.weight", (kv, h), "weight")]
        if cfg["model_type"] == "qwen2":  # Qwen2's q, k and v biases (zeros, as transformers')
            out += [(p + "self_attn.q_proj.bias", (h,), "bias"),
                    (p + "self_attn.k_proj.bias", (kv,), "bias"),
                    (p + "self_attn.v_proj.bias", (kv,), "bias")]
        out += [
                (p + "self_attn.o_proj.weight", (h, h), "weight"),
                (p + "post_attention_layernorm.weight", (h,), "norm"),
                (p + "mlp.gate_proj.weight", (f, h), "weight"),
                (p + "mlp.up_proj.weight", (f, h), "weight"),
                (p + "mlp.down_proj.weight", (h, f), "weight")]
    out += [("model.norm.weight", (h,), "norm"), ("lm_head.weight", (v, h), "weight")]
    return out


def to_bf16(x):
    """float32 -> bfloat16 bits, rounded to nearest even (finite inputs)."""
    u = x.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def write_weights(path, cfg, seed, std=0.02):
    """A bf16 model.safetensors, streamed tensor by tensor in slices of rows (a 70B FFN matrix
    is 235M elements: never more than 16M of them in memory at once)."""
    specs = tensors_of(cfg)
    header = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _ in specs:
        n = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    rng = np.random.default_rng(seed)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name, shape, kind in specs:
            if kind in ("norm", "bias"):
                value = np.ones if kind == "norm" else np.zeros
                f.write(to_bf16(value(shape, np.float32)).tobytes())
                continue
            cols = shape[1]
            step = max(1, (16 << 20) // cols)
            for r in range(0, shape[0], step):
                rows = min(step, shape[0] - r)
                block = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(std)
                f.write(to_bf16(block).tobytes())
    os.replace(tmp, path)
    return offset


def size_class(n):
    """The pinned pool's block size for a request of n bytes (device/pinned_pool.cc SizeClass)."""
    if n <= 4096:
        return 4096
    if n <= 64 << 10:
        return 1 << (n - 1).bit_length()
    step = 1 << ((n - 1).bit_length() - 1 - 3)
    return (n + step - 1) // step * step


def run(cmd, env=None):
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"llama70b_layers: {' '.join(cmd)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r.stdout


def meminfo():
    with open("/proc/meminfo") as f:
        fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return fields


class Sampler(threading.Thread):
    """Samples the node's memory in use (MemTotal - MemAvailable) and the swap files' sizes."""

    def __init__(self, nvme_dir, period=0.25):
        super().__init__(daemon=True)
        self.nvme_dir, self.period = nvme_dir, period
        self.base_used = self.used()
        self.peak_used = 0
        self.files = {}
        self.stop = threading.Event()

    @staticmethod
    def used():
        m = meminfo()
        return m["MemTotal"] - m["MemAvailable"]

    def run(self):
        while not self.stop.is_set():
            self.peak_used = max(self.peak_used, self.used())
            for root, _, names in os.walk(self.nvme_dir):
                for n in names:
                    if n.endswith(".swap"):
                        try:
                            self.files[n] = max(self.files.get(n, 0),
                                                os.path.getsize(os.path.join(root, n)))
                        except OSError:
                            pass
            self.stop.wait(self.period)


def gib(b):
    return b / 2**30


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--strata", required=True)
    ap.add_argument("--mpirun", default=shutil.which("mpirun") or "mpirun")
    ap.add_argument("--mode", choices=["lora", "full"], default="lora")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096,
                    help="the vocabulary, cut from Llama-3's 128256 (default 4096)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=None,
                    help="AdamW learning rate (default 1e-3 with LoRA, 1e-5 full)")
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--corpus-tokens", default=None,
                    help="tokens of the synthetic corpus (default: one global batch, ranks x "
                         "seq-len + 1, so that every step trains on the same sequences: over a few "
                         "steps, different batches' losses differ more than training moves them)")
    ap.add_argument("--dir", help="work directory (default: a temporary one, removed)")
    ap.add_argument("--nvme", help="directory for the swap files (default: DIR/nvme)")
    ap.add_argument("--shape", choices=["70b", "qwen72b", "1t"], default="70b")
    ap.add_argument("--ffn", type=int, default=None,
                    help="cut the FFN width to this (the 1T layer's 86016 does not fit a small host)")
    ap.add_argument("--smoke", action="store_true",
                    help="a small layer shape (hidden 512) to check the script itself")
    ap.add_argument("--stream", action="store_true",
                    help="bound the parameters' host tier (strata.memory.host_budget) to two layer "
                         "shards, the least the engine takes, so that with 3 or more layers the "
                         "base weights stream from NVMe for forward and again for backward every "
                         "step instead of staying in host memory after the first read (with 2 "
                         "layers, two shards are nearly the whole model)")
    ap.add_argument("--split", action="store_true",
                    help="strata.split_blocks: each decoder layer as four units (attention, gate, "
                         "up, down), so one MLP matrix is gathered at a time, not a layer")
    ap.add_argument("--force", action="store_true",
                    help="train even where the estimate says this host's memory is too small")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    work = a.dir or tempfile.mkdtemp(prefix="strata-70b-")
    os.makedirs(work, exist_ok=True)
    nvme = a.nvme or os.path.join(work, "nvme")
    shutil.rmtree(nvme, ignore_errors=True)
    os.makedirs(nvme)
    shape = dict(SHAPE_SMOKE if a.smoke else SHAPE_1T if a.shape == "1t"
                 else SHAPE_QWEN72B if a.shape == "qwen72b" else SHAPE_70B)
    if a.ffn:
        shape["ffn"] = a.ffn
        shape["name"] += f" (FFN cut to {a.ffn})"
    cfg = model_config(shape, a.layers, a.vocab)
    model = os.path.join(work, "model")
    os.makedirs(model, exist_ok=True)
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    weights = os.path.join(model, "model.safetensors")
    stamp = os.path.join(model, "weights.json")
    want = {"config": cfg, "seed": 70}
    t0 = time.time()
    if not (os.path.exists(weights) and os.path.exists(stamp) and json.load(open(stamp)) == want):
        write_weights(weights, cfg, seed=70)
        with open(stamp, "w") as f:
            json.dump(want, f)
    weights_s = time.time() - t0
    data = os.path.join(work, "tokens.bin")
    corpus = a.corpus_tokens or str(a.ranks * a.seq_len + 1)
    run([a.strata, "data", "synth", "--out", data, "--tokens", corpus, "--vocab", str(a.vocab),
         "--seed", "7"])

    lr = a.lr if a.lr is not None else (1e-3 if a.mode == "lora" else 1e-5)
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
          "bf16": {"enabled": True},
          "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0}},
          "zero_optimization": {
              "stage": 3, "sub_group_size": 20_000_000, "stage3_max_live_parameters": 100_000_000,
              "offload_param": {"device": "nvme", "nvme_path": nvme},
              "offload_optimizer": {"device": "nvme", "nvme_path": nvme}},
          "strata": {"seed": 1}}
    if a.split:
        ds["strata"]["split_blocks"] = True
    if a.mode == "full":
        # DeepSpeed's default bucket (5e8 fp32 elements, 1.86 GiB of device memory per rank) is
        # sized for many small tensors; here every unit but the norms is larger than 5e7.
        ds["zero_optimization"]["reduce_bucket_size"] = 50_000_000
        # Optimizer sub-groups of 1e7 elements: three in flight take 0.36 GiB of pinned memory
        # per rank, not 0.72.
        ds["zero_optimization"]["sub_group_size"] = 10_000_000
    if a.stream:
        # Two of the largest shard (a decoder layer's, or with --split an MLP matrix's, in bf16,
        # with the shard's alignment) in the pinned pool's size classes.
        layer = sum(math.prod(shp) for n, shp, _ in tensors_of(cfg) if ".layers.0." in n)
        if a.split:
            layer = max(math.prod(shp) for n, shp, _ in tensors_of(cfg) if ".layers.0.mlp." in n)
        shard = 2 * math.ceil(layer / a.ranks) + 8192
        ds["strata"]["memory"] = {"host_budget": 2 * size_class(shard)}
    if a.mode == "lora":
        ds["strata"]["lora"] = {"r": a.lora_r, "lora_alpha": 2 * a.lora_r,
                                "target_modules": "all-linear"}
    ds_path = os.path.join(work, "ds.json")
    with open(ds_path, "w") as f:
        json.dump(ds, f, indent=2)

    mem = meminfo()
    estimate = [a.strata, "estimate", "--model", model, "--config", ds_path, "--device", "cpu",
                "--ranks", str(a.ranks), "--seq-len", str(a.seq_len),
                "--cpu-mem", str(mem["MemTotal"]), "--json"]
    est = json.loads(run(estimate))
    per_rank = est["device"]["peak_bytes"] + est["pinned_pool_bytes"] + est["host_setup_bytes"]
    node_need = est["fit"]["host_need_bytes"]
    available = mem["MemAvailable"]
    result = {"mode": a.mode, "stream": a.stream, "split": a.split, "layers": a.layers, "corpus_tokens": corpus,
              "lr": lr, "vocab": a.vocab, "ranks": a.ranks,
              "seq_len": a.seq_len, "shape": shape, "parameters": est["parameters"],
              "trainable_parameters": est["trainable_parameters"], "weights_write_s": weights_s,
              "host_mem_total_bytes": mem["MemTotal"], "host_mem_available_bytes": available,
              "estimate": {"device_peak_bytes": est["device"]["peak_bytes"],
                           "pinned_pool_bytes": est["pinned_pool_bytes"],
                           "host_setup_bytes": est["host_setup_bytes"],
                           "rank_resident_bytes": per_rank, "node_host_need_bytes": node_need,
                           "nvme": est["nvme"], "step_s": est["time"]["step_s"]}}
    if node_need > available and not a.force:
        result["ran"] = False
        result["why_not"] = (f"the node needs {gib(node_need):.2f} GiB (per rank: device peak "
                             f"{gib(est['device']['peak_bytes']):.2f} + pinned pool "
                             f"{gib(est['pinned_pool_bytes']):.2f} + set-up "
                             f"{gib(est['host_setup_bytes']):.2f} GiB) and this host has "
                             f"{gib(available):.2f} GiB available")
        report(result, a.json)
        if not a.dir:
            shutil.rmtree(work, ignore_errors=True)
        return 0

    metrics = os.path.join(work, "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd = [a.strata, "train", "--model", model, "--config", ds_path, "--data", data,
           "--device", "cpu", "--seq-len", str(a.seq_len), "--steps", str(a.steps),
           "--sampling", "sequential", "--metrics", metrics]
    if a.ranks > 1:
        cmd = [a.mpirun, "-np", str(a.ranks), "--bind-to", "none"] + cmd
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    sampler = Sampler(nvme)
    sampler.start()
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.time() - t0
    sampler.stop.set()
    sampler.join()
    log = os.path.join(work, "train.log")
    with open(log, "w") as f:
        f.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        sys.exit(f"llama70b_layers: strata train failed ({proc.returncode}); log: {log}\n"
                 + (proc.stdout + proc.stderr)[-4000:])
    with open(metrics) as f:
        steps = [json.loads(line) for line in f if line.strip()]
    losses = [s["loss"] for s in steps]
    later = steps[1:] or steps
    med = lambda k: statistics.median(s[k] for s in later)
    dev_peak = max(s["device_peak_bytes"] for s in steps)
    rss = max(s["host_rss_peak_bytes"] for s in steps)
    swap = {n: b for n, b in sampler.files.items() if n.startswith("strata.rank0.")}
    est_files = {"param": est["nvme"]["param_file_bytes"], "optim": est["nvme"]["optim_file_bytes"]}
    result.update({
        "ran": True, "wall_s": wall, "log": log,
        "losses": losses,
        "loss_finite": all(math.isfinite(x) for x in losses),
        "loss_decreasing": len(losses) > 1 and losses[-1] < losses[0],
        "loss_monotone": all(b < a for a, b in zip(losses, losses[1:])),
        "step_s": med("step_s"), "compute_s": med("compute_s"),
        "exposed_comm_s": med("exposed_comm_s"), "exposed_io_s": med("exposed_io_s"),
        "exposed_optimizer_s": med("exposed_optimizer_s"),
        "nvme_read_bytes_per_step": med("nvme_read_bytes"),
        "nvme_write_bytes_per_step": med("nvme_write_bytes"),
        "tflops": med("tflops"),
        "measured": {"device_peak_bytes": dev_peak,
                     "pinned_pool_bytes": steps[-1]["pinned_pool_bytes"],
                     "pinned_pool_peak_bytes": max(s["pinned_pool_peak_bytes"] for s in steps),
                     "rank0_rss_peak_bytes": rss,
                     "node_used_peak_bytes": sampler.peak_used - sampler.base_used,
                     "swap_files": swap},
        "ratios": {"device_peak": dev_peak / est["device"]["peak_bytes"],
                   "pinned_pool": steps[-1]["pinned_pool_bytes"] / est["pinned_pool_bytes"],
                   "rank0_rss_over_rank_estimate": rss / per_rank,
                   "node_used_over_node_estimate": (sampler.peak_used - sampler.base_used) / node_need,
                   **{f"swap_{k}": next((b / est_files[k] for n, b in swap.items() if f".{k}." in n), None)
                      for k in est_files if est_files[k]}},
    })
    result["device_peak_within_5pct"] = abs(result["ratios"]["device_peak"] - 1) <= 0.05
    report(result, a.json)
    if not a.dir:
        shutil.rmtree(work, ignore_errors=True)
    ok = result["loss_finite"] and result["loss_decreasing"] and result["device_peak_within_5pct"]
    return 0 if ok else 1


def report(r, as_json):
    if as_json:
        print(json.dumps(r, indent=2))
        return
    e = r["estimate"]
    s = r["shape"]
    print(f"{s['name']} layer shape (hidden {s['hidden']}, {s['heads']} heads, {s['kv']} KV heads, "
          f"FFN {s['ffn']}), {r['layers']} layers, vocabulary {r['vocab']}: "
          f"{r['parameters'] / 1e9:.3f}B parameters, {r['trainable_parameters'] / 1e6:.1f}M train "
          f"({r['mode']}{', streamed' if r['stream'] else ''}{', split blocks' if r.get('split') else ''}); ZeRO-3 on {r['ranks']} ranks of the CPU device, parameters and "
          f"optimizer on NVMe, 1 x {r['seq_len']} tokens per rank")
    if not r["ran"]:
        print(f"not run: {r['why_not']}")
        return
    m = r["measured"]
    rows = [("device peak per rank (rank 0)", e["device_peak_bytes"], m["device_peak_bytes"]),
            ("pinned pool per rank", e["pinned_pool_bytes"], m["pinned_pool_bytes"]),
            ("  its high-water mark", e["pinned_pool_bytes"], m["pinned_pool_peak_bytes"]),
            ("resident per rank (rank 0's peak RSS)", e["rank_resident_bytes"], m["rank0_rss_peak_bytes"]),
            ("node memory in use (sampled peak)", e["node_host_need_bytes"], m["node_used_peak_bytes"])]
    for n, b in sorted(m["swap_files"].items()):
        k = "param" if ".param." in n else "optim"
        rows.append((f"NVMe {n}", e["nvme"][f"{k}_file_bytes"], b))
    print(f"{'':<40} {'estimate':>12} {'measured':>12} {'ratio':>7}")
    for name, est, meas in rows:
        print(f"{name:<40} {gib(est):>10.3f}Gi {gib(meas):>10.3f}Gi {meas / est if est else 0:>7.4f}")
    print("loss per step: " + ", ".join(f"{x:.4f}" for x in r["losses"]) +
          f" (finite: {r['loss_finite']}, last below first: {r['loss_decreasing']}, every step "
          f"below the one before: {r['loss_monotone']})")
    print(f"step {r['step_s']:.2f} s (median after the first) = compute {r['compute_s']:.2f} + "
          f"comm {r['exposed_comm_s']:.2f} + io {r['exposed_io_s']:.2f} + optimizer "
          f"{r['exposed_optimizer_s']:.2f}; {r['tflops'] * 1e3:.1f} GFLOPS over the ranks; NVMe "
          f"read {gib(r['nvme_read_bytes_per_step']):.2f} GiB and write "
          f"{gib(r['nvme_write_bytes_per_step']):.3f} GiB per step; the run took {r['wall_s']:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
