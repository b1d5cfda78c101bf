#!/usr/bin/env python3
"""The GPU check's verdict: reads what `deploy/gpu-check.sh run` left in DIR/steps and
DIR/steps.tsv and writes OUT/summary.md and OUT/summary.json (and prints the former). The run
calls it after every step, so the output folder always holds the verdict so far.

The check passes when every step ran and exited 0 and every GPU test passed: a skipped GPU test is
a failure (a broken CUDA set-up must never look green), and so is a test executable that ran fewer
GPU tests than the build machine listed. Benchmark targets are reported, met or not, but do not
fail the check: they are measurements.

Standard library only: it runs under whatever python3 the GPU machine has.
"""

import argparse
import glob
import json
import os
import re
import sys
import traceback
import xml.etree.ElementTree as ET

ADAM_TARGET = 1.0  # Strata's fused AdamW step time against PyTorch's fused AdamW: >= 1.0x
ATTENTION_TARGET = 0.9  # attention forward + backward against SDPA (issue 40): >= 0.9x
# The micro-benchmarks' steps (gpu-check.sh run --micro): their tables appear when one ran.
MICRO_STEPS = re.compile(r"^(copy_(strata|pytorch)|adam_(strata|pytorch)|checksum_cost|overlap_L\d+)$")
OVERLAP_TARGET = 1.10  # overlap efficiency at L = 32 and 128: <= 1.10


def load_json(path):
    """The JSON document at `path`, or None (with the reason) when it is absent or broken."""
    if not os.path.exists(path):
        return None, "not written"
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f), None
    except (OSError, ValueError) as e:
        return None, f"unreadable: {e}"


def read_steps(steps_dir):
    """steps.tsv: name -> {rc, seconds, note}."""
    steps = {}
    path = os.path.join(os.path.dirname(steps_dir), "steps.tsv")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                parts = line.rstrip("\n").split("\t")
                if len(parts) >= 3:
                    steps[parts[0]] = {"rc": parts[1], "seconds": int(parts[2] or 0),
                                       "note": parts[3] if len(parts) > 3 else ""}
    return steps


def first_words(message):
    """A GoogleTest message on one line: its "file:line" prefix dropped, at most 300 characters."""
    lines = [l.strip() for l in (message or "").splitlines() if l.strip()]
    if len(lines) > 1 and lines[0].rsplit(":", 1)[-1].isdigit():
        lines = lines[1:]
    text = " | ".join(lines)
    return text if len(text) <= 300 else text[:297] + "..."


def parse_gtest_log(path):
    """Counts from a test executable's console output, for when it died before writing its XML:
    the tests that finished ([ OK ], [ FAILED ], [ SKIPPED ]) and the one it was in."""
    result = {"tests": 0, "passed": 0, "failed": [], "skipped": [], "from_log": True}
    if not os.path.exists(path):
        return result
    running = None
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            m = re.match(r"\[\s*(RUN|OK|FAILED|SKIPPED)\s*\] (\S+)", line)
            if not m:
                continue
            kind, name = m.groups()
            if kind == "RUN":
                running = name
                continue
            if name != running:
                continue  # the summary lines at the end repeat the names
            running = None
            result["tests"] += 1
            if kind == "OK":
                result["passed"] += 1
            elif kind == "FAILED":
                result["failed"].append({"test": name, "message": "see the step's log"})
            else:
                result["skipped"].append({"test": name, "message": "see the step's log"})
    if running:
        result["tests"] += 1
        result["failed"].append({"test": running, "message": "the executable died in this test"})
    return result


def parse_gtest_xml(path):
    """Counts and the names of failed and skipped tests from a GoogleTest XML report."""
    result = {"tests": 0, "passed": 0, "failed": [], "skipped": []}
    root = ET.parse(path).getroot()
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}.{case.get('name', '')}"
        result["tests"] += 1
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        skipped = case.find("skipped")
        if failure is not None:
            result["failed"].append({"test": name, "message": first_words(failure.get("message"))})
        elif case.get("result") == "skipped" or skipped is not None:
            message = skipped.get("message") if skipped is not None else ""
            result["skipped"].append({"test": name, "message": first_words(message)})
        elif case.get("status", "run") == "run":
            result["passed"] += 1
    return result


def pcie_limit(env, nvidia_smi_log):
    """The link's raw bytes/s per direction, from `strata env --json`, else from nvidia-smi."""
    try:
        dev = env["gpu"]["devices"][0]
        limit = float(dev["pcie"]["max_bytes_per_s"])
        if limit > 0:
            gen = dev["pcie"]["generation"]
            return limit, f"PCIe gen{gen} x{dev['pcie']['max_width']} (strata env)"
    except (TypeError, KeyError, IndexError, ValueError):
        pass
    # nvidia-smi's CSV: pcie.link.gen.max and pcie.link.width.max are columns 5 and 7.
    if nvidia_smi_log and os.path.exists(nvidia_smi_log):
        with open(nvidia_smi_log, encoding="utf-8", errors="replace") as f:
            lines = [l for l in f.read().splitlines() if l.strip() and not l.startswith("name")]
        for line in lines:
            cols = [c.strip() for c in line.split(",")]
            try:
                gen, width = int(cols[4]), int(cols[6])
            except (IndexError, ValueError):
                continue
            gts = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0}.get(gen)
            if gts:
                eff = 0.8 if gen <= 2 else (128 / 130 if gen <= 5 else 242 / 256)
                return gts * 1e9 * width * eff / 8, f"PCIe gen{gen} x{width} (nvidia-smi)"
    return None, "unknown (neither strata env nor nvidia-smi reported the link)"


def fmt(x, spec=".2f", none="-"):
    return none if x is None else format(x, spec)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="the run's work folder (holds steps/)")
    parser.add_argument("--out", help="where summary.md and summary.json go (default: --dir)")
    parser.add_argument("--bench", type=int, default=1, help="1 when the benchmarks were run")
    parser.add_argument("--phase", default="check", choices=["check", "train"],
                        help="check: the tests and micro-benchmarks; train: the training "
                             "benchmarks (run --train)")
    parser.add_argument("--quiet", action="store_true", help="do not print summary.md")
    args = parser.parse_args()
    out = args.out or args.dir
    try:
        return report(args, out)
    except Exception:  # the verdict must always be written, even from data this code did not expect
        text = ("# GPU check: FAILED\n\nThe report could not be made from this run's files:\n\n```\n"
                + traceback.format_exc() + "```\n")
        with open(os.path.join(out, "summary.md"), "w", encoding="utf-8") as f:
            f.write(text)
        with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as f:
            json.dump({"passed": False, "problems": ["the report failed: " + traceback.format_exc()]}, f)
        if not args.quiet:
            print(text)
        return 1


def report(args, out):
    steps_dir = os.path.join(args.dir, "steps")
    steps = read_steps(steps_dir)
    manifest, _ = load_json(os.path.join(steps_dir, "manifest.json"))
    env, _ = load_json(os.path.join(steps_dir, "env.json"))
    problems = []  # what fails the check

    for name, s in steps.items():
        if s["rc"] != "0" and not name.startswith("info_"):
            what = s["note"] or f"exit {s['rc']}"
            problems.append(f"step {name}: {what}")

    # ---- the machine
    machine = {}
    if env:
        gpu = env.get("gpu") or {}
        devices = gpu.get("devices", [])
        machine = {
            "gpu": devices[0]["name"] if devices else None,
            "gpu_memory_bytes": devices[0]["memory_bytes"] if devices else None,
            "gpus": len(devices),
            "cuda_runtime": gpu.get("runtime_version"),
            "cuda_driver": gpu.get("driver_version"),
            "nccl_headers": gpu.get("nccl_version"),
            "none_reason": gpu.get("none_reason"),
            "pcie": devices[0].get("pcie") if devices else None,
            "numa_node": devices[0].get("numa_node") if devices else None,
        }
        if not devices:
            problems.append(f"no GPU: {gpu.get('none_reason', 'strata env found none')}")
    else:
        problems.append("strata env --json wrote nothing")

    # ---- tests (not part of the training phase)
    expected = (manifest or {}).get("gpu_test_executables", {})
    if args.phase == "train":
        expected = {}
    tests = {}
    for exe, listed in sorted(expected.items()):
        xml_path = os.path.join(steps_dir, f"test_{exe}.xml")
        entry = {"listed": listed}
        log_path = os.path.join(steps_dir, f"test_{exe}.log")
        if not os.path.exists(xml_path):
            entry["error"] = "no XML report (the executable did not run, or died)"
            problems.append(f"{exe}: {entry['error']}")
            if os.path.exists(log_path):
                entry.update(parse_gtest_log(log_path))
                for f in entry["failed"]:
                    problems.append(f"{exe}: FAILED {f['test']}: {f['message']}")
        else:
            try:
                entry.update(parse_gtest_xml(xml_path))
                # Tests run in processes of their own (gpu-check.sh: test_<exe>.<part>.xml).
                for part in sorted(glob.glob(os.path.join(steps_dir, f"test_{exe}.*.xml"))):
                    more = parse_gtest_xml(part)
                    for key in ("tests", "passed"):
                        entry[key] += more[key]
                    entry["failed"] += more["failed"]
                    entry["skipped"] += more["skipped"]
            except ET.ParseError as e:
                entry["error"] = f"unreadable XML report: {e}"
                problems.append(f"{exe}: {entry['error']}")
            else:
                for f in entry["failed"]:
                    problems.append(f"{exe}: FAILED {f['test']}: {f['message']}")
                # Skips usually share one reason (no GPU): one line per reason.
                reasons = {}
                for s in entry["skipped"]:
                    reasons.setdefault(s["message"], []).append(s["test"])
                for message, names in reasons.items():
                    problems.append(f"{exe}: SKIPPED {len(names)} (a skip fails the check), "
                                    f"e.g. {names[0]}: {message}")
                if entry["tests"] < listed:
                    problems.append(f"{exe}: ran {entry['tests']} GPU tests, {listed} were listed")
        tests[exe] = entry
    if not expected and args.phase != "train":
        problems.append("the manifest lists no test executable with GPU tests")
    totals = {k: sum(len(t.get(k, [])) if k in ("failed", "skipped") else t.get(k, 0)
                     for t in tests.values()) for k in ("tests", "passed", "failed", "skipped")}

    # ---- benchmarks
    bench = {}
    # The micro-benchmarks run with --micro only: their tables when any of their steps ran (or
    # left a document).
    micro = any(MICRO_STEPS.match(name) for name in steps) or any(
        MICRO_STEPS.match(os.path.basename(p)[:-len(".json")])
        for p in glob.glob(os.path.join(steps_dir, "*.json")))
    if args.bench and micro:
        limit, limit_source = pcie_limit(env, os.path.join(steps_dir, "info_nvidia_smi.log"))
        cs, cs_err = load_json(os.path.join(steps_dir, "copy_strata.json"))
        cp, cp_err = load_json(os.path.join(steps_dir, "copy_pytorch.json"))
        copy = {"pcie_limit_gb_per_s": limit / 1e9 if limit else None, "pcie_link": limit_source,
                "rows": []}
        for mode in ("h2d", "d2h", "both"):
            s = (cs or {}).get("results", {}).get(mode, {}).get("gb_per_s")
            p = (cp or {}).get("results", {}).get(mode, {}).get("gb_per_s")
            # "both" moves two directions at once: its limit is twice the one-way link.
            mode_limit = (2 if mode == "both" else 1) * limit / 1e9 if limit else None
            copy["rows"].append({
                "mode": mode, "strata_gb_per_s": s, "pytorch_gb_per_s": p,
                "strata_over_pytorch": s / p if s and p else None,
                "strata_of_link": s / mode_limit if s and mode_limit else None,
                "pytorch_of_link": p / mode_limit if p and mode_limit else None})
        copy["errors"] = {k: v for k, v in (("strata", cs_err), ("pytorch", cp_err)) if v}
        bench["copy"] = copy

        as_, as_err = load_json(os.path.join(steps_dir, "adam_strata.json"))
        ap, ap_err = load_json(os.path.join(steps_dir, "adam_pytorch.json"))
        s_ms = (as_ or {}).get("variants", {}).get("fp32", {}).get("median_ms")
        p_ms = (ap or {}).get("variants", {}).get("fp32", {}).get("median_ms")
        speedup = p_ms / s_ms if s_ms and p_ms else None
        bench["adam"] = {
            "params": (as_ or {}).get("params"),
            "strata_fp32_ms": s_ms,
            "strata_fp32_gb_per_s": (as_ or {}).get("variants", {}).get("fp32", {}).get("gb_per_s"),
            "strata_fp32_bf16_ms": (as_ or {}).get("variants", {}).get("fp32+bf16", {}).get("median_ms"),
            "pytorch_fused_ms": p_ms,
            "pytorch_fused_gb_per_s": (ap or {}).get("variants", {}).get("fp32", {}).get("gb_per_s"),
            "speedup_over_pytorch": speedup, "target": ADAM_TARGET,
            "met": speedup is not None and speedup >= ADAM_TARGET,
            "check": (as_ or {}).get("check"),
            "errors": {k: v for k, v in (("strata", as_err), ("pytorch", ap_err)) if v}}

        # Offload checksums' cost (strata nvme-bench --checksum-cost), issue 19's < 2% target.
        ck, ck_err = load_json(os.path.join(steps_dir, "checksum_cost.json"))
        cc = (ck or {}).get("checksum_cost") or {}
        bench["checksum_cost"] = {
            "write_cost": (cc.get("write") or {}).get("cost"),
            "read_cost": (cc.get("read") or {}).get("cost"),
            "write_plain_gb_per_s": (cc.get("write") or {}).get("plain_gb_per_s"),
            "read_plain_gb_per_s": (cc.get("read") or {}).get("plain_gb_per_s"),
            "hash_gb_per_s": cc.get("hash_gb_per_s"), "target": cc.get("target_cost", 0.02),
            "met": cc.get("meets_target"), "error": ck_err}

        # One document per L (overlap_L<units>.json), merged.
        ov, ov_err, results = None, None, []
        paths = sorted(glob.glob(os.path.join(steps_dir, "overlap_L*.json")),
                       key=lambda p: int(re.sub(r"\D", "", os.path.basename(p)) or 0))
        for path in paths:
            doc, err = load_json(path)
            if doc:
                ov = ov or doc
                results.extend(doc.get("results", []))
            else:
                ov_err = f"{os.path.basename(path)}: {err}"
        if not paths:
            ov_err = "not run"
        rows = []
        for r in results:
            rows.append({k: r.get(k) for k in (
                "units", "gemm_m", "gemm_n", "io_only_s", "compute_only_s", "balance", "step_s",
                "efficiency", "paired_efficiency", "no_prefetch_efficiency", "hit_rate",
                "device_peak_bytes", "device_budget_bytes")})
            rows[-1]["met"] = r.get("efficiency") is not None and r["efficiency"] <= OVERLAP_TARGET
        bench["overlap"] = {"rows": rows, "target": OVERLAP_TARGET,
                            "store": (ov or {}).get("backend"), "direct": (ov or {}).get("direct"),
                            "unit_bytes": (ov or {}).get("unit_bytes"), "error": ov_err}

    if args.bench:
        # Attention, one pair of documents per shape (attention_{strata,pytorch}_<shape>.json),
        # and Strata on its own kernels (attention_strata_kernels_<shape>.json, STRATA_ATTENTION=
        # kernels: no cuDNN) as a second row against the same PyTorch document when present.
        att_rows = []
        tags = {re.sub(r"^attention_strata_(kernels_)?", "", os.path.basename(p)[:-len(".json")])
                for p in glob.glob(os.path.join(steps_dir, "attention_strata_*.json"))}
        for tag in sorted(tags, key=lambda t: (int(re.sub(r"\D", "", t) or 0), t)):
            pt, pt_err = load_json(os.path.join(steps_dir, f"attention_pytorch_{tag}.json"))
            for variant, name in (("", f"attention_strata_{tag}.json"),
                                  ("kernels", f"attention_strata_kernels_{tag}.json")):
                path = os.path.join(steps_dir, name)
                if not os.path.exists(path) and name[:-len(".json")] not in steps:
                    continue  # not measured in this run
                st, st_err = load_json(path)
                row = {"shape": tag, "strata_attention": variant,
                       "errors": {k: v for k, v in (("strata", st_err), ("pytorch", pt_err)) if v}}
                for key in ("forward", "forward_backward"):
                    sm = (st or {}).get("results", {}).get(key, {}).get("median_ms")
                    pm = (pt or {}).get("results", {}).get(key, {}).get("median_ms")
                    row[f"strata_{key}_ms"] = sm
                    row[f"pytorch_{key}_ms"] = pm
                    row[f"strata_{key}_tflops"] = (st or {}).get("results", {}).get(key, {}).get("tflops")
                    row[f"{key}_speedup_over_pytorch"] = pm / sm if sm and pm else None
                # Which attention each side ran (strata_gpu_bench: cuDNN's, the tiled or the
                # exact kernels; gpu_peers.py: the SDPA backend PyTorch chose), when it says.
                row["strata_backend"] = (st or {}).get("backend")
                row["pytorch_backend"] = (pt or {}).get("backend")
                r = row["forward_backward_speedup_over_pytorch"]
                row["target"] = ATTENTION_TARGET
                row["met"] = None if r is None else r >= ATTENTION_TARGET
                sh = (st or pt or {}).get("shape")
                row["description"] = (f"(b{sh['batch']} s{sh['seq']} h{sh['heads']}/{sh['kv_heads']} "
                                      f"d{sh['head_dim']})") if sh else None
                att_rows.append(row)
        bench["attention"] = att_rows

    # ---- training (run --train): one document per scenario, train_<scenario>.json
    # In the order the steps ran (gpu-check.sh: the most important first).
    training = []
    order = {name: i for i, name in enumerate(steps)}
    for path in sorted(glob.glob(os.path.join(steps_dir, "train_*.json")),
                       key=lambda p: (order.get(os.path.basename(p)[:-len(".json")], len(order)),
                                      p)):
        doc, err = load_json(path)
        if not doc:
            training.append({"file": os.path.basename(path), "error": err})
            continue
        for scenario, r in doc.get("results", {}).items():
            st, pt = r.get("strata", {}), r.get("pytorch", {})
            training.append({
                "scenario": scenario + (f" (STRATA_ATTENTION={doc['attention']})"
                                        if doc.get("attention") else ""),
                "model": doc.get("model"), "seq_len": doc.get("seq_len"),
                "micro_batch": doc.get("micro_batch"), "bf16": doc.get("bf16"),
                "strata_tokens_per_s": st.get("tokens_per_s"), "strata_step_s": st.get("step_s"),
                "strata_tflops": st.get("tflops"), "strata_error": st.get("error"),
                "strata_device_peak_bytes": st.get("device_peak_bytes"),
                "peer": pt.get("mode"), "peer_tokens_per_s": pt.get("tokens_per_s"),
                "peer_error": pt.get("error") or pt.get("skipped"),
                "ratio": r.get("ratio"), "target": r.get("target"), "met": r.get("met"),
                "floor_terms_s": r.get("floor_terms_s"), "floor_missing": r.get("floor_missing"),
                "placement": [l for l in st.get("placement", []) if l.startswith("chosen:")],
                "op_profile": st.get("op_profile") or [],
                "estimate": r.get("estimate")})
            # DeepSpeed beside cpu-optim (ZeRO-Offload) and nvme (ZeRO-Infinity), when it ran:
            # a row of its own; its failure is reported, not a failed check.
            ds = r.get("deepspeed")
            if ds is not None:
                training.append({
                    "scenario": scenario, "deepspeed_row": True,
                    "model": doc.get("model"), "seq_len": doc.get("seq_len"),
                    "micro_batch": doc.get("micro_batch"), "bf16": doc.get("bf16"),
                    "strata_tokens_per_s": st.get("tokens_per_s"), "strata_step_s": st.get("step_s"),
                    "strata_tflops": st.get("tflops"), "strata_error": None,
                    "peer": " ".join(x for x in (
                        "DeepSpeed", str(ds.get("deepspeed") or ""),
                        "ZeRO-Offload" if scenario == "cpu-optim" else "ZeRO-Infinity") if x),
                    "peer_tokens_per_s": ds.get("tokens_per_s"),
                    "peer_error": ds.get("error") or ds.get("skipped"),
                    "ratio": r.get("deepspeed_ratio"), "target": r.get("deepspeed_target"),
                    "met": r.get("deepspeed_met") if ds.get("tokens_per_s") else None,
                    "floor_terms_s": None, "floor_missing": None, "placement": [],
                    "op_profile": [], "estimate": None})
    if args.phase == "train" and not training:
        problems.append("no training benchmark wrote its results")

    passed = not problems
    summary = {"passed": passed, "problems": problems, "machine": machine, "tests": tests,
               "test_totals": totals, "benchmarks": bench, "training": training,
               "steps": steps, "carry": manifest}

    # ---- the table for people
    md = []
    gpu_name = machine.get("gpu") or "no GPU"
    md.append(f"# GPU check: {'PASSED' if passed else 'FAILED'}")
    md.append("")
    md.append(f"- GPU: {gpu_name}, {fmt((machine.get('gpu_memory_bytes') or 0) / 2**30, '.1f')} GiB; "
              f"CUDA runtime {machine.get('cuda_runtime')}, driver {machine.get('cuda_driver')}; "
              f"NUMA node {machine.get('numa_node')}")
    if manifest:
        md.append(f"- build: commit {manifest.get('commit', '?')[:12]}"
                  f"{' (with uncommitted changes)' if manifest.get('uncommitted_changes') else ''}, "
                  f"prepared {manifest.get('prepared')}")
    if args.phase == "train":
        md.append("- the training phase (`run --train`): the GPU tests ran in `run`")
    else:
        md.append(f"- GPU tests: {totals['passed']} passed, {totals['failed']} failed, "
                  f"{totals['skipped']} skipped (a skip fails the check), of {totals['tests']} run")
        md.append("")
        md.append("| test executable | listed | ran | passed | failed | skipped |")
        md.append("| --- | ---: | ---: | ---: | ---: | ---: |")
        for exe, t in tests.items():
            md.append(f"| {exe} | {t['listed']} | {t.get('tests', 0)} | {t.get('passed', 0)} | "
                      f"{len(t.get('failed', []))} | {len(t.get('skipped', []))} |")
    if bench.get("attention"):
        md.append("")
        md.append("Attention (causal, GQA; Strata's fp32 activations with bf16 tensor-core "
                  "arithmetic, PyTorch's scaled_dot_product_attention on bf16 tensors); ms, "
                  f"and PyTorch / Strata (above 1: Strata faster; target fwd+bwd >= "
                  f"{ATTENTION_TARGET}). Rows marked STRATA_ATTENTION=kernels ran Strata's own "
                  "kernels (no cuDNN) against the same PyTorch run")
        md.append("")
        md.append("| shape | fwd Strata | fwd PyTorch | fwd ratio | fwd+bwd Strata | "
                  "fwd+bwd PyTorch | fwd+bwd ratio | Strata TFLOP/s fwd+bwd | target | note |")
        md.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |")
        for r in bench["attention"]:
            label = (f"{r['shape']}, STRATA_ATTENTION={r['strata_attention']}"
                     if r["strata_attention"] else f"{r['shape']} {r['description'] or ''}")
            md.append(f"| {label} | "
                      f"{fmt(r['strata_forward_ms'], '.3f')} | "
                      f"{fmt(r['pytorch_forward_ms'], '.3f')} | "
                      f"{fmt(r['forward_speedup_over_pytorch'])} | "
                      f"{fmt(r['strata_forward_backward_ms'], '.3f')} | "
                      f"{fmt(r['pytorch_forward_backward_ms'], '.3f')} | "
                      f"{fmt(r['forward_backward_speedup_over_pytorch'])} | "
                      f"{fmt(r['strata_forward_backward_tflops'], '.1f')} | "
                      f"{'-' if r['met'] is None else ('met' if r['met'] else 'NOT met')} | "
                      + "; ".join([f"{side} {r[key]}" for side, key in (
                          ("Strata", "strata_backend"), ("SDPA", "pytorch_backend")) if r[key]]
                                  + [f"{k}: {v}" for k, v in r["errors"].items()]) + " |")
    if bench.get("copy"):
        c = bench["copy"]
        md.append("")
        md.append(f"Host <-> device copies through the registered pinned pool, GB/s (link: "
                  f"{c['pcie_link']}, {fmt(c['pcie_limit_gb_per_s'], '.1f')} GB/s per direction)")
        md.append("")
        md.append("| mode | Strata | PyTorch | Strata / PyTorch | Strata / link | PyTorch / link |")
        md.append("| --- | ---: | ---: | ---: | ---: | ---: |")
        for r in c["rows"]:
            md.append(f"| {r['mode']} | {fmt(r['strata_gb_per_s'], '.1f')} | "
                      f"{fmt(r['pytorch_gb_per_s'], '.1f')} | {fmt(r['strata_over_pytorch'])} | "
                      f"{fmt(r['strata_of_link'])} | {fmt(r['pytorch_of_link'])} |")
        a = bench["adam"]
        md.append("")
        md.append(f"Fused AdamW, {a['params'] or '-'} fp32 parameters: Strata {fmt(a['strata_fp32_ms'], '.3f')} ms "
                  f"({fmt(a['strata_fp32_gb_per_s'], '.0f')} GB/s; with the bf16 copy "
                  f"{fmt(a['strata_fp32_bf16_ms'], '.3f')} ms), PyTorch fused {fmt(a['pytorch_fused_ms'], '.3f')} ms "
                  f"({fmt(a['pytorch_fused_gb_per_s'], '.0f')} GB/s): "
                  f"**{fmt(a['speedup_over_pytorch'])}x** (target >= {ADAM_TARGET}: "
                  f"{'met' if a['met'] else 'NOT met'})")
        k = bench.get("checksum_cost") or {}
        if k:
            md.append("")
            md.append(f"Offload checksums (XXH3, {fmt(k['hash_gb_per_s'], '.1f')} GB/s per thread): "
                      f"write cost {fmt(k['write_cost'], '.3f')} at {fmt(k['write_plain_gb_per_s'], '.2f')} GB/s, "
                      f"read cost {fmt(k['read_cost'], '.3f')} at {fmt(k['read_plain_gb_per_s'], '.2f')} GB/s "
                      f"(target < {k['target']}: "
                      f"{'-' if k['met'] is None else ('met' if k['met'] else 'NOT met')})"
                      + (f"; {k['error']}" if k["error"] else ""))
        o = bench["overlap"]
        md.append("")
        md.append(f"Overlap, NVMe -> pinned -> HBM with a cuBLAS GEMM per unit (store {o['store']}, "
                  f"O_DIRECT {o['direct']}): efficiency = step / max(io-only, compute-only), "
                  f"target <= {OVERLAP_TARGET}")
        md.append("")
        md.append("| L | GEMM M x N | io-only s | compute s | step s | efficiency | paired | no prefetch | hit rate | target |")
        md.append("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
        for r in o["rows"]:
            md.append(f"| {r['units']} | {r['gemm_m']} x {r['gemm_n']} | {fmt(r['io_only_s'], '.3f')} | "
                      f"{fmt(r['compute_only_s'], '.3f')} | {fmt(r['step_s'], '.3f')} | "
                      f"{fmt(r['efficiency'], '.3f')} | {fmt(r['paired_efficiency'], '.3f')} | "
                      f"{fmt(r['no_prefetch_efficiency'], '.2f')} | {fmt(r['hit_rate'], '.3f')} | "
                      f"{'met' if r['met'] else 'NOT met'} |")
        if not o["rows"]:
            md.append(f"| - | no result: {o['error'] or 'the benchmark wrote no rows'} | | | | | | | | |")
    if training:
        md.append("")
        md.append("Training (`strata train --device cuda`; hbm against PyTorch eager, cpu-optim "
                  "against FSDP2 + CPUOffloadPolicy and DeepSpeed ZeRO-Offload, nvme against its "
                  "floor and DeepSpeed ZeRO-Infinity):")
        md.append("")
        md.append("| scenario | model | seq x batch | Strata tok/s | TFLOPS | peer | peer tok/s "
                  "| ratio | target | note |")
        md.append("| --- | --- | --- | ---: | ---: | --- | ---: | ---: | --- | --- |")
        for t in training:
            if "error" in t and "scenario" not in t:
                md.append(f"| {t['file']} | | | | | | | | | {t['error']} |")
                continue
            note = "; ".join(x for x in (
                f"strata: {t['strata_error']}" if t["strata_error"] else "",
                f"peer: {t['peer_error']}" if t["peer_error"] else "",
                f"floor terms {t['floor_terms_s']}" if t["floor_terms_s"] else "",
                f"missing {t['floor_missing']}" if t["floor_missing"] else "",
                "; ".join(t.get("placement") or [])) if x)
            target = "-" if t["target"] is None else (
                f"<= {t['target']}" if t["scenario"] == "nvme" and not t.get("deepspeed_row")
                else f">= {t['target']}")
            md.append(f"| {t['scenario']} | {t['model']} {'bf16' if t['bf16'] else 'fp32'} | "
                      f"{t['seq_len']} x {t['micro_batch']} | {fmt(t['strata_tokens_per_s'], '.0f')} | "
                      f"{fmt(t['strata_tflops'], '.1f')} | {t['peer'] or '-'} | "
                      f"{fmt(t['peer_tokens_per_s'], '.0f')} | {fmt(t['ratio'])} | {target} "
                      f"{'' if t['met'] is None else ('met' if t['met'] else 'NOT met')} | {note} |")
        estimated = [t for t in training if t.get("estimate")]
        if estimated:
            md.append("")
            md.append("Against `strata estimate` (the same config; compute calibrated on hbm; "
                      "targets: device peak within 5%, step within 25%):")
            md.append("")
            md.append("| scenario | device peak measured / estimated | step estimated / measured "
                      "| estimate's bottleneck |")
            md.append("| --- | ---: | ---: | --- |")
            for t in estimated:
                e = t["estimate"]
                if "error" in e:
                    md.append(f"| {t['scenario']} | | | {e['error']} |")
                    continue
                md.append(f"| {t['scenario']} | {fmt(e.get('device_peak_ratio'), '.3f')} | "
                          f"{fmt(e.get('step_ratio'))} | {e.get('bottleneck', '')} |")
        for t in training:
            if t.get("op_profile"):
                md.append("")
                md.append(f"Strata's {t['scenario']} step by op (`strata train --profile-ops`):")
                md.append("")
                md.append("```")
                md.extend(t["op_profile"])
                md.append("```")
    md.append("")
    md.append("| step | exit | seconds | note |")
    md.append("| --- | --- | ---: | --- |")
    for name, s in steps.items():
        md.append(f"| {name} | {s['rc']} | {s['seconds']} | {s['note']} |")
    if problems:
        md.append("")
        md.append("What fails the check:")
        md.extend(f"- {p}" for p in problems[:60])
        if len(problems) > 60:
            md.append(f"- ... and {len(problems) - 60} more (summary.json)")
    text = "\n".join(md) + "\n"
    # Written next to each other and replaced whole, so that a reader never sees half a file.
    for name, content in (("summary.md", text), ("summary.json", json.dumps(summary, indent=2))):
        tmp = os.path.join(out, name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(content)
        os.replace(tmp, os.path.join(out, name))
    if not args.quiet:
        print(text)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
