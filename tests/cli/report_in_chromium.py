#!/usr/bin/env python3
"""report_in_chromium.py: `strata report` renders in a real browser.

Trains llama-tiny for 12 steps with ZeRO-3 and parameters and optimizer states on NVMe, with
the smallest host tier (so every chart has data), writes the report with the run's trace, then has Debian's chromium, headless,
load the page: its DOM must hold the page title and every chart's heading, and its screenshot
must not be blank (a good share of non-white pixels, and the charts' own colours present).

Usage: report_in_chromium.py STRATA WORKDIR. Exit 0: passed; 77: skipped (no chromium or no
Python imaging library, with the reason); 1: failed.
"""
import json
import os
import shutil
import subprocess
import sys


def chromium():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def main():
    strata, work = sys.argv[1], sys.argv[2]
    browser = chromium()
    if not browser:
        print("SKIP: no chromium on PATH (deploy/install-deps.sh installs Debian's)")
        return 77
    try:
        from PIL import Image
    except ImportError:
        print("SKIP: no Python imaging library (python3-pil)")
        return 77
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    data = os.path.join(work, "tokens.bin")
    subprocess.run([strata, "data", "synth", "--out", data, "--tokens", "20k", "--vocab", "256"],
                   check=True, capture_output=True)
    nvme = os.path.join(work, "nvme")
    os.makedirs(nvme)
    cfg = {"train_micro_batch_size_per_gpu": 2,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
           "zero_optimization": {"stage": 3,
                                 "offload_param": {"device": "nvme", "nvme_path": nvme},
                                 "offload_optimizer": {"device": "nvme", "nvme_path": nvme}},
           # The smallest host tier: the parameters go to NVMe and back every step.
           "strata": {"memory": {"host_budget": "64KiB"}}}
    config = os.path.join(work, "ds.json")
    with open(config, "w") as f:
        json.dump(cfg, f)
    metrics, trace = os.path.join(work, "metrics.jsonl"), os.path.join(work, "trace.json")
    subprocess.run([strata, "train", "--config", config, "--model", "llama-tiny", "--data", data,
                    "--seq-len", "32", "--steps", "12", "--device", "cpu", "--metrics", metrics,
                    "--trace", trace], check=True, capture_output=True)
    page = os.path.join(work, "report.html")
    r = subprocess.run([strata, "report", metrics, "--trace", trace, "--out", page],
                       capture_output=True, text=True, check=True)
    failures = []

    def check(ok, what):
        print(("ok    " if ok else "FAIL  ") + what)
        if not ok:
            failures.append(what)

    check(f"wrote {page}" in r.stdout, f"strata report prints the page's path ({r.stdout.strip()})")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             "--user-data-dir=" + os.path.join(work, "profile")]
    dom = subprocess.run([browser, *flags, "--dump-dom", "file://" + page], capture_output=True,
                         text=True, timeout=120).stdout
    for title in ("Strata training report", "Loss", "Tokens per second", "Step time split",
                  "NVMe bytes per step", "Peak memory per tier", "Trace: time by span"):
        check(title in dom, f"the rendered DOM holds '{title}'")
    check(dom.count("<svg") == 5, f"five charts in the DOM ({dom.count('<svg')})")
    shot = os.path.join(work, "report.png")
    subprocess.run([browser, *flags, "--window-size=860,2400", "--screenshot=" + shot,
                    "file://" + page], capture_output=True, timeout=120)
    check(os.path.exists(shot), "chromium wrote a screenshot")
    if os.path.exists(shot):
        img = Image.open(shot).convert("RGB")
        pixels = list(img.getdata())
        non_white = sum(1 for p in pixels if p != (255, 255, 255)) / len(pixels)
        check(non_white > 0.03, f"the screenshot is not blank ({non_white:.1%} non-white)")
        colours = set(pixels)
        for name, rgb in (("train loss blue", (0x1F, 0x77, 0xB4)),
                          ("tokens/s green", (0x2C, 0xA0, 0x2C)),
                          ("communication orange", (0xFF, 0x7F, 0x0E)),
                          ("NVMe read cyan", (0x17, 0xBE, 0xCF))):
            check(rgb in colours, f"the {name} is drawn")
    print(f"report_in_chromium: {len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
