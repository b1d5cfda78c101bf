#!/usr/bin/env bash
# The Python peers of the tests and benchmarks: a virtual environment over Debian's python3 with
# its python3-torch (--system-site-packages: PyPI's torch wheels carry CUDA and are gigabytes),
# and from PyPI at pinned versions transformers, safetensors and peft (the `hf` tests, tests/hf)
# and DeepSpeed (benchmarks/adam_vs_deepspeed.py and aio_vs_deepspeed.py: its CPU Adam and async
# I/O ops, built by its op builder against Debian's libtorch-dev, pybind11-dev and libaio-dev,
# which deploy/install-deps.sh installs).
#
#   deploy/hf-venv.sh [DIR]     # default: build/hf-venv in the repository; prints DIR/bin/python
#
# Idempotent: a stamp file records what was installed, and a second call with the same pins
# only checks the imports. Needs network access to PyPI the first time (about 30 s here).
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
dir="${1:-$root/build/hf-venv}"
python=/usr/bin/python3

# Pinned: transformers 4.40 is the newest line that supports Debian 12's torch 1.13. peft goes in
# without its dependencies: it asks for torch >= 1.13.0, which Debian's 1.13.0a0 does not satisfy
# by pip's rules, and pip would fetch a CUDA build of torch (gigabytes) into the environment; its
# other dependencies are listed here (accelerate among them).
# tensorboard: its event-file reader checks what the "tensorboard" monitor writes.
pins=(transformers==4.40.2 safetensors==0.4.3 accelerate==0.29.3 psutil==5.9.8
  hjson==3.1.0 py-cpuinfo==9.0.0 pydantic==1.10.17 ninja==1.11.1.1 tensorboard==2.16.2
  protobuf==4.25.3)
# DeepSpeed 0.12: the newest whose CPU Adam compiles as C++14, what torch 1.13's extension
# builder uses; without its dependencies for the same reason as peft (and it would add pynvml).
nodeps=(peft==0.10.0 deepspeed==0.12.6)
stamp="$dir/.strata-hf-venv"
want="${pins[*]} ${nodeps[*]}"

die() { echo "hf-venv: $*" >&2; exit 1; }

[ -x "$python" ] || die "$python not found: deploy/install-deps.sh installs Debian's python3"
"$python" -c 'import torch' 2>/dev/null ||
  die "$python cannot import torch: deploy/install-deps.sh installs python3-torch"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$dir/bin/python" ]; then
  "$dir/bin/python" -c 'import torch, transformers, safetensors, peft, deepspeed, tensorboard' 2>/dev/null ||
    die "$dir: the installed packages do not import; remove $dir and run again"
  echo "$dir/bin/python"
  exit 0
fi

echo "hf-venv: creating $dir ($want, torch from Debian)" >&2
rm -rf "$dir"
"$python" -m venv --system-site-packages "$dir" ||
  die "cannot create a virtual environment (Debian's python3-venv package is needed)"
"$dir/bin/pip" install --quiet --disable-pip-version-check "${pins[@]}" ||
  die "pip install ${pins[*]} failed (is PyPI reachable?)"
"$dir/bin/pip" install --quiet --disable-pip-version-check --no-deps "${nodeps[@]}" ||
  die "pip install ${nodeps[*]} failed (is PyPI reachable?)"
# torch must be Debian's (the environment sees the system's site-packages).
"$dir/bin/python" -c 'import sys, torch; sys.exit(0 if torch.__file__.startswith("/usr/") else 1)' ||
  die "$dir has a torch of its own, not Debian's: a pinned package pulled one in"
"$dir/bin/python" - <<'EOF' >&2
import peft, safetensors, torch, transformers
import deepspeed
print(f"hf-venv: torch {torch.__version__}, transformers {transformers.__version__}, "
      f"safetensors {safetensors.__version__}, peft {peft.__version__}, "
      f"deepspeed {deepspeed.__version__}")
EOF
echo "$want" >"$stamp"
echo "$dir/bin/python"
