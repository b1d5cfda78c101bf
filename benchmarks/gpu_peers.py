#!/usr/bin/env python3
"""gpu_peers.py: the PyTorch side of strata_gpu_bench (benchmarks/gpu_bench.cc).

The same measurements as strata_gpu_bench, taken through PyTorch on the same machine, with the
same sizes, the same timing method and the same JSON shape ("impl": "pytorch"), so that a script
(deploy/gpu-check.sh) can divide one by the other:

  copy   host<->device bandwidth between pinned host tensors
         (torch.empty(..., dtype=torch.uint8, pin_memory=True)) and device tensors:
         dst.copy_(src, non_blocking=True) per --chunk on dedicated torch.cuda.Streams.
           h2d   host -> device on one stream;
           d2h   device -> host on another;
           both  the two at once, each on its stream: the combined rate (2 x --bytes over the
                 time until both are done) and each direction's (--bytes over the time until its
                 stream is done).
         Before timing, both device tensors make one round trip and must come back byte for byte.
  adam   torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
         fused=True) on one fp32 CUDA parameter of --params elements with p.grad set: the
         "fp32" variant of strata_gpu_bench adam. Bytes per step counted as Strata counts them:
         read p, grad, m, v (16 B/param) + write p, m, v (12 B) = 28 B/param. One untimed step
         creates the optimizer state first.
  attention  torch.nn.functional.scaled_dot_product_attention(is_causal=True) on --dtype
         tensors in Strata's [batch, seq, heads, head_dim] layout (seen through a transpose),
         grouped-query heads through enable_gqa (repeat_interleave before timing on torch < 2.5):
         the forward alone (no_grad), then forward + backward. TFLOP/s count the causal pairs
         only: 4 b h d s(s+1)/2 for the forward, 3.5 times that for forward + backward.

Timing, as on the C++ side: the host clock (time.perf_counter) from before the first enqueue to
after the streams are synchronized; the median over --reps measurements after --warmup untimed
ones (adam: a measurement is a batch of --batch steps, divided by --batch). Rates are decimal
GB/s (1e9 bytes/s).

Sizes accept strata's syntax: 1048576, 5e8, 512K, 64MiB, 1GiB, 2GB (K/M/G/T and KiB/MiB/GiB/TiB
are powers of 1024; kB/MB/GB/TB powers of 1000; the unit's case does not matter).

Exit status: 0 on success; 2 when torch cannot be imported or has no usable CUDA device (one line
on stderr saying which), and for malformed options (argparse's usage errors name the option);
1 when a measurement fails (a CUDA error, the data check).

Standalone: the standard library and torch only.
"""

import argparse
import json
import re
import statistics
import sys
import threading
import time
from decimal import Decimal, InvalidOperation

PROG = "gpu_peers.py"

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tib": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
_SIZE = re.compile(r"^(\d[\d.]*(?:[eE]\+?\d+)?)([A-Za-z]*)$")


def parse_size(text):
    """A byte count in strata's syntax (common/units.h ParseByteSize); ValueError otherwise."""
    expected = (
        "expected a whole number of bytes such as 1048576, 5e8, 512K, 4MiB or 2GB "
        "(K/M/G/T and KiB/MiB/GiB/TiB are powers of 1024; kB/MB/GB/TB powers of 1000)"
    )
    match = _SIZE.match(text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f"'{text}' is not a byte size; {expected}")
    try:
        value = Decimal(match.group(1)) * _UNITS[match.group(2).lower()]
    except InvalidOperation:
        raise ValueError(f"'{text}' is not a byte size; {expected}") from None
    if value != value.to_integral_value():
        raise ValueError(f"'{text}' is not a whole number of bytes ({value})")
    return int(value)


def positive_size(text):
    try:
        value = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"'{text}': expected a positive byte count")
    return value


def int_at_least(low):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value}: expected at least {low}")
        return value

    return parse


def modes_list(text):
    modes = []
    for mode in text.split(","):
        if mode not in ("h2d", "d2h", "both"):
            raise argparse.ArgumentTypeError(
                f"'{text}': expected a comma-separated list of h2d, d2h, both"
            )
        if mode not in modes:
            modes.append(mode)
    return modes


def unavailable(message):
    """The one line for a machine where this peer cannot run, and exit status 2."""
    print(f"{PROG}: {' '.join(message.split())}", file=sys.stderr)
    sys.exit(2)


def load_torch():
    try:
        import torch  # noqa: PLC0415 (imported here so that option errors need no torch)
    except Exception as e:  # ImportError, or a broken install failing while it loads
        unavailable(
            f"cannot import torch ({type(e).__name__}: {e}); this peer needs PyTorch with CUDA"
        )
    if not torch.cuda.is_available():
        unavailable(
            f"PyTorch {torch.__version__} has no usable CUDA device (built for CUDA "
            f"{torch.version.cuda or 'none'}, {torch.cuda.device_count()} device(s) visible); "
            "this peer needs one"
        )
    return torch


def cuda_device(torch, ordinal):
    count = torch.cuda.device_count()
    if ordinal >= count:
        unavailable(f"--ordinal {ordinal}: only {count} CUDA device(s) visible")
    return torch.device("cuda", ordinal)


def say(args, text):
    """The table: stdout, or stderr when stdout carries the JSON document."""
    print(text, file=sys.stderr if args.json else sys.stdout, flush=True)


def blocking_wait(torch, stream, event=None):
    """Waits for `stream` as Strata's Device::Synchronize does: on an event created with
    cudaEventBlockingSync, so the thread sleeps instead of spinning and both sides pay the same
    wake-up latency. `event` (a torch.cuda.Event(blocking=True)) may be passed in, made ahead."""
    if event is None:
        event = torch.cuda.Event(blocking=True)
    event.record(stream)
    event.synchronize()


def synchronize_each(torch, streams, events=None):
    """Waits for each stream, each on its own thread (the first on this one); returns the
    perf_counter() at which each was seen complete. torch releases the GIL while it waits."""
    done = [0.0] * len(streams)
    errors = [None] * len(streams)

    def wait(k):
        try:
            blocking_wait(torch, streams[k], events[k] if events else None)
        except BaseException as e:  # re-raised below, on the main thread
            errors[k] = e
        done[k] = time.perf_counter()

    waiters = [threading.Thread(target=wait, args=(k,)) for k in range(1, len(streams))]
    for t in waiters:
        t.start()
    wait(0)
    for t in waiters:
        t.join()
    for e in errors:
        if e is not None:
            raise e
    return done


def chunk_views(dst, src, nbytes, chunk):
    """(dst view, src view) per chunk: sliced before timing, so that no Python slicing is timed."""
    return [(dst[o : o + chunk], src[o : o + chunk]) for o in range(0, nbytes, chunk)]


def enqueue(torch, directions):
    """directions: [(stream, [(dst, src), ...])]; chunk k of each before chunk k + 1 of any."""
    if len(directions) == 1:
        stream, views = directions[0]
        with torch.cuda.stream(stream):
            for dst, src in views:
                dst.copy_(src, non_blocking=True)
        return
    for k in range(len(directions[0][1])):
        for stream, views in directions:
            dst, src = views[k]
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)


def time_copies(torch, directions):
    events = [torch.cuda.Event(blocking=True) for _ in directions]
    t0 = time.perf_counter()
    enqueue(torch, directions)
    return [t - t0 for t in synchronize_each(torch, [stream for stream, _ in directions], events)]


def run_copy(torch, args):
    device = cuda_device(torch, args.ordinal)
    torch.cuda.set_device(device)
    nbytes, chunk = args.bytes, args.chunk
    host_src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev_dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev_src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d_stream = torch.cuda.Stream(device=device)
    d2h_stream = torch.cuda.Stream(device=device)
    torch.cuda.synchronize(device)

    h2d = (h2d_stream, chunk_views(dev_dst, host_src, nbytes, chunk))
    d2h = (d2h_stream, chunk_views(host_dst, dev_src, nbytes, chunk))

    # The check, which also gives both device tensors their data: one round trip each, into a
    # host tensor that differs from the source in every byte beforehand.
    generator = torch.Generator()
    generator.manual_seed(0x5EED)
    words = nbytes // 8  # 8 bytes per draw: a GiB takes a fraction of a second
    if words:
        host_src[: words * 8].view(torch.int64).random_(generator=generator)
    if nbytes % 8:
        host_src[words * 8 :].random_(0, 256, generator=generator)
    for name, device_tensor in (("the h2d destination", dev_dst), ("the d2h source", dev_src)):
        torch.bitwise_not(host_src, out=host_dst)
        time_copies(torch, [(h2d_stream, chunk_views(device_tensor, host_src, nbytes, chunk))])
        time_copies(torch, [(d2h_stream, chunk_views(host_dst, device_tensor, nbytes, chunk))])
        if not torch.equal(host_src, host_dst):
            wrong = int((host_src != host_dst).sum())
            first = int((host_src != host_dst).nonzero()[0])
            print(
                f"{PROG} copy: data check failed ({name}): after h2d and d2h, byte {first} of "
                f"{nbytes} differs ({wrong} bytes differ)",
                file=sys.stderr,
            )
            sys.exit(1)

    directions_of = {"h2d": [h2d], "d2h": [d2h], "both": [h2d, d2h]}
    name = torch.cuda.get_device_name(device)
    chunks = (nbytes + chunk - 1) // chunk
    say(
        args,
        f"gpu_peers.py copy: PyTorch {torch.__version__} on {name}, {nbytes} B per measurement as "
        f"{chunks} copies of at most {chunk} B, pinned host tensors, median of {args.reps} after "
        f"{args.warmup} warm-up",
    )
    times = {mode: [[] for _ in directions_of[mode]] for mode in args.modes}
    for round_ in range(args.warmup + args.reps):
        # Rotate which mode goes first, as the C++ side does.
        for j in range(len(args.modes)):
            mode = args.modes[(j + round_) % len(args.modes)]
            done = time_copies(torch, directions_of[mode])
            if round_ >= args.warmup:
                for d, t in enumerate(done):
                    times[mode][d].append(t)

    results = {}
    say(
        args,
        f"{'mode':<6}{'GB/s':>10}{'median s':>12}{'min s':>12}{'h2d GB/s':>11}{'d2h GB/s':>11}",
    )
    for mode in args.modes:
        per_direction = times[mode]
        if len(per_direction) == 1:
            median = statistics.median(per_direction[0])
            results[mode] = {
                "gb_per_s": nbytes / median / 1e9,
                "median_s": median,
                "min_s": min(per_direction[0]),
            }
            say(
                args,
                f"{mode:<6}{nbytes / median / 1e9:>10.2f}{median:>12.6f}"
                f"{min(per_direction[0]):>12.6f}",
            )
            continue
        combined = [max(a, b) for a, b in zip(*per_direction)]
        median = statistics.median(combined)
        h2d_median = statistics.median(per_direction[0])
        d2h_median = statistics.median(per_direction[1])
        results[mode] = {
            "gb_per_s": 2 * nbytes / median / 1e9,
            "median_s": median,
            "min_s": min(combined),
            "h2d_gb_per_s": nbytes / h2d_median / 1e9,
            "d2h_gb_per_s": nbytes / d2h_median / 1e9,
            "h2d_median_s": h2d_median,
            "d2h_median_s": d2h_median,
        }
        say(
            args,
            f"{mode:<6}{2 * nbytes / median / 1e9:>10.2f}{median:>12.6f}{min(combined):>12.6f}"
            f"{nbytes / h2d_median / 1e9:>11.2f}{nbytes / d2h_median / 1e9:>11.2f}",
        )
    say(args, "data check: both device tensors made a round trip byte for byte")
    return {
        "bench": "copy",
        "impl": "pytorch",
        "device": name,
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "bytes": nbytes,
        "chunk": chunk,
        "chunks": chunks,
        "reps": args.reps,
        "warmup": args.warmup,
        "check": "round trip byte for byte",
        "results": results,
    }


def run_adam(torch, args):
    device = cuda_device(torch, args.ordinal)
    torch.cuda.set_device(device)
    n = args.params
    generator = torch.Generator(device=device)
    generator.manual_seed(1234)
    param = torch.nn.Parameter(torch.empty(n, dtype=torch.float32, device=device))
    with torch.no_grad():
        param.uniform_(-1.0, 1.0, generator=generator)
    param.grad = torch.empty(n, dtype=torch.float32, device=device).uniform_(
        -0.1, 0.1, generator=generator
    )
    opt = torch.optim.AdamW(
        [param], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, fused=True
    )
    opt.step()  # step 1 creates exp_avg, exp_avg_sq and the step count: not timed
    torch.cuda.synchronize(device)

    name = torch.cuda.get_device_name(device)
    say(
        args,
        f"gpu_peers.py adam: PyTorch {torch.__version__} on {name}, {n} fp32 params, "
        "AdamW(fused=True) lr 1e-3 betas 0.9/0.999 eps 1e-8 weight_decay 0.01, "
        f"median of {args.reps} batches of {args.batch} steps after {args.warmup} warm-up batches",
    )
    per_step = []
    stream = torch.cuda.current_stream(device)
    done = torch.cuda.Event(blocking=True)
    for round_ in range(args.warmup + args.reps):
        t0 = time.perf_counter()
        for _ in range(args.batch):
            opt.step()
        blocking_wait(torch, stream, done)
        seconds = (time.perf_counter() - t0) / args.batch
        if round_ >= args.warmup:
            per_step.append(seconds)
    if not bool(torch.isfinite(param).all()):
        print(f"{PROG} adam: the parameter holds NaN or Inf after the timed steps", file=sys.stderr)
        sys.exit(1)

    median = statistics.median(per_step)
    bytes_per_param = 28.0
    gb = bytes_per_param * n / median / 1e9
    say(args, f"{'variant':<11}{'median ms':>11}{'min ms':>11}{'GB/s':>10}{'B/param':>9}")
    say(
        args,
        f"{'fp32':<11}{median * 1e3:>11.4f}{min(per_step) * 1e3:>11.4f}{gb:>10.1f}"
        f"{bytes_per_param:>9.0f}",
    )
    return {
        "bench": "adam",
        "impl": "pytorch",
        "device": name,
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "params": n,
        "reps": args.reps,
        "warmup": args.warmup,
        "batch": args.batch,
        "hyper": {
            "lr": 1e-3,
            "betas": [0.9, 0.999],
            "eps": 1e-8,
            "weight_decay": 0.01,
            "adamw": True,
            "fused": True,
        },
        "variants": {
            "fp32": {
                "median_ms": median * 1e3,
                "min_ms": min(per_step) * 1e3,
                "gb_per_s": gb,
                "bytes_per_param": bytes_per_param,
            }
        },
    }


def attention_flops(batch, seq, heads, head_dim):
    """Causal attention's forward FLOPs (Q K^T and P V over the pairs j <= i), as strata_gpu_bench
    counts them; the backward counts 2.5 times as many (five products against two)."""
    return 4.0 * batch * heads * head_dim * (seq * (seq + 1) / 2)


def sdpa_backend(torch, q, k, v, extra):
    """The kernel PyTorch's dispatcher picks for these inputs ("flash_attention", "cudnn_attention",
    "efficient_attention", "math"), from its own choice function (a private one: "unknown" where
    this torch lacks it)."""
    try:
        choice = torch._fused_sdp_choice(q, k, v, is_causal=True, **extra)
        return torch.nn.attention.SDPBackend(choice).name.lower()
    except Exception:  # noqa: BLE001 - any failure here only loses the label
        return "unknown"


def run_attention(torch, args):
    device = cuda_device(torch, args.ordinal)
    torch.cuda.set_device(device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    b, s, h, kvh, d = args.batch, args.seq, args.heads, args.kv_heads, args.head_dim
    if h % kvh != 0:
        print(f"{PROG} attention: --heads {h} is not a multiple of --kv-heads {kvh}",
              file=sys.stderr)
        sys.exit(2)
    generator = torch.Generator(device=device)
    generator.manual_seed(1234)

    # Strata's layout, [batch, seq, heads, head_dim], seen as [batch, heads, seq, head_dim].
    def tensor(heads):
        x = torch.empty(b, s, heads, d, dtype=torch.float32, device=device)
        x.uniform_(-1.0, 1.0, generator=generator)
        return x.to(dtype).transpose(1, 2)

    q, k, v, dout = tensor(h), tensor(kvh), tensor(kvh), tensor(h)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    try:
        sdpa(q[:, :, :1], k[:, :, :1], v[:, :, :1], is_causal=True, enable_gqa=True)
        gqa = "enable_gqa"
    except TypeError:  # torch < 2.5: the kv heads repeated once, before timing
        k = k.repeat_interleave(h // kvh, dim=1)
        v = v.repeat_interleave(h // kvh, dim=1)
        gqa = "repeat_interleave"
    extra = {"enable_gqa": True} if gqa == "enable_gqa" else {}
    qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
    stream = torch.cuda.current_stream(device)
    done = torch.cuda.Event(blocking=True)

    def timed(fn):
        per = []
        for round_ in range(args.warmup + args.reps):
            t0 = time.perf_counter()
            fn()
            blocking_wait(torch, stream, done)
            if round_ >= args.warmup:
                per.append(time.perf_counter() - t0)
        return per

    def forward():
        with torch.no_grad():
            return sdpa(q, k, v, is_causal=True, **extra)

    def forward_backward():
        qg.grad = kg.grad = vg.grad = None  # no accumulation kernels in the timing
        out = sdpa(qg, kg, vg, is_causal=True, **extra)
        out.backward(dout)

    backend = sdpa_backend(torch, q, k, v, extra)
    fwd = timed(forward)
    fwd_bwd = timed(forward_backward)
    out = forward()
    if not (bool(torch.isfinite(out).all()) and bool(torch.isfinite(qg.grad).all())):
        print(f"{PROG} attention: the output or dq holds NaN or Inf", file=sys.stderr)
        sys.exit(1)

    name = torch.cuda.get_device_name(device)
    flops = attention_flops(b, s, h, d)
    f_ms, fb_ms = statistics.median(fwd) * 1e3, statistics.median(fwd_bwd) * 1e3
    f_tf, fb_tf = flops / (f_ms * 1e-3) / 1e12, 3.5 * flops / (fb_ms * 1e-3) / 1e12
    say(args, f"gpu_peers.py attention: PyTorch {torch.__version__} on {name}, "
              f"scaled_dot_product_attention (causal, {gqa}; backend {backend}), "
              f"{args.dtype} inputs, batch {b}, "
              f"seq {s}, heads {h}/{kvh}, head_dim {d}; median of {args.reps} after "
              f"{args.warmup} warm-up")
    say(args, f"{'pass':<18}{'median ms':>11}{'min ms':>11}{'TFLOP/s':>10}")
    say(args, f"{'forward':<18}{f_ms:>11.3f}{min(fwd) * 1e3:>11.3f}{f_tf:>10.1f}")
    say(args, f"{'forward+backward':<18}{fb_ms:>11.3f}{min(fwd_bwd) * 1e3:>11.3f}{fb_tf:>10.1f}")
    return {
        "bench": "attention",
        "impl": "pytorch",
        "device": name,
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "gqa": gqa,
        "backend": backend,
        "shape": {"batch": b, "seq": s, "heads": h, "kv_heads": kvh, "head_dim": d},
        "dtype": args.dtype,
        "reps": args.reps,
        "warmup": args.warmup,
        "forward_flops": flops,
        "results": {
            "forward": {"median_ms": f_ms, "min_ms": min(fwd) * 1e3, "tflops": f_tf},
            "forward_backward": {"median_ms": fb_ms, "min_ms": min(fwd_bwd) * 1e3,
                                 "tflops": fb_tf},
        },
    }


def build_parser():
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="strata_gpu_bench's measurements through PyTorch (copy, adam, attention)",
    )
    sub = parser.add_subparsers(dest="bench", metavar="{copy,adam,attention}")
    sub.required = True

    def common(p):
        p.add_argument("--ordinal", type=int_at_least(0), default=0, help="CUDA device index")
        p.add_argument("--reps", type=int_at_least(1), default=10,
                       help="timed measurements (the median is reported) [10]")
        p.add_argument("--warmup", type=int_at_least(0), default=2,
                       help="untimed measurements before them [2]")
        p.add_argument("--json", action="store_true",
                       help="print one JSON document on stdout (the table goes to stderr)")

    copy = sub.add_parser("copy", help="host<->device bandwidth, pinned host tensors")
    common(copy)
    copy.add_argument("--bytes", type=positive_size, default=positive_size("1GiB"),
                      help="bytes moved per measurement [1GiB]")
    copy.add_argument("--chunk", type=positive_size, default=positive_size("64MiB"),
                      help="bytes per copy_ call [64MiB]")
    copy.add_argument("--modes", type=modes_list, default=["h2d", "d2h", "both"],
                      help="comma-separated: h2d, d2h, both [all three]")

    adam = sub.add_parser("adam", help="torch.optim.AdamW(fused=True) on one fp32 parameter")
    common(adam)
    adam.add_argument("--params", type=int_at_least(1), default=1 << 27,
                      help="fp32 elements of the parameter [134217728]")
    adam.add_argument("--batch", type=int_at_least(1), default=10,
                      help="steps per timed measurement [10]")

    att = sub.add_parser("attention",
                         help="causal scaled_dot_product_attention, forward and backward")
    common(att)
    att.add_argument("--batch", type=int_at_least(1), default=1, help="sequences [1]")
    att.add_argument("--seq", type=int_at_least(1), default=2048, help="tokens per sequence [2048]")
    att.add_argument("--heads", type=int_at_least(1), default=16, help="query heads [16]")
    att.add_argument("--kv-heads", type=int_at_least(1), default=8, help="key/value heads [8]")
    att.add_argument("--head-dim", type=int_at_least(1), default=128, help="head_dim [128]")
    att.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16",
                     help="input dtype [bf16]")
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.bench == "copy" and args.chunk > args.bytes:
        parser.error(
            f"argument --chunk: {args.chunk} B: expected no more than --bytes ({args.bytes} B)"
        )
    torch = load_torch()
    try:
        run = {"copy": run_copy, "adam": run_adam, "attention": run_attention}[args.bench]
        doc = run(torch, args)
    except (RuntimeError, MemoryError) as e:  # CUDA errors, out of memory
        print(f"{PROG} {args.bench}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
