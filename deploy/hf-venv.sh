#!/usr/bin/env bash
# The Python peers of the tests and benchmarks, at the releases users run today: torch 2.15 from
# PyPI (with the CUDA libraries its wheel pulls in), transformers 5.24, tokenizers 0.23,
# safetensors 0.8, peft 0.21, accelerate 1.15 and DeepSpeed 0.19.8, every dependency pinned in
# deploy/hf-requirements.txt. The `hf` tests (tests/hf), the data preparation helper and the
# DeepSpeed benchmarks (benchmarks/adam_vs_deepspeed.py, aio_vs_deepspeed.py: DeepSpeed's CPU Adam
# and async I/O ops, JIT-built against this torch and Debian's libaio-dev) run under it.
#
#   deploy/hf-venv.sh [LINK]   # prints the environment's python
#
# The environment is large (about 5.6 GB, nearly all of it torch's CUDA libraries: PyPI has no
# CPU-only torch for Linux) and is made once per machine, outside the source tree:
# ${STRATA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/strata}/hf-venv-<key>, where the key hashes
# the pins and the Python version, so a fresh clone or a second build tree reuses it and a change
# of pins makes a new one. LINK (default: build/hf-venv in the repository) becomes a symbolic link
# to it. Making it takes about 4 minutes here, nearly all of it downloading torch; a second call
# with the same pins only checks the imports.
set -euo pipefail
# Only the python's path goes to stdout (callers capture it); everything else to stderr.
exec 3>&1 1>&2

root="$(cd "$(dirname "$0")/.." && pwd)"
link="${1:-$root/build/hf-venv}"
python=/usr/bin/python3
requirements="$root/deploy/hf-requirements.txt"
# DeepSpeed is a source distribution whose setup.py imports torch: it is installed after torch,
# without build isolation (which would download torch again), without its compiled ops (they are
# JIT-built on first use) and without dependencies (all of them are in the requirements).
deepspeed=deepspeed==0.19.8

die() { echo "hf-venv: $*" >&2; exit 1; }

[ -x "$python" ] || die "$python not found: deploy/install-deps.sh installs Debian's python3"
"$python" -c 'import venv, ensurepip' 2>/dev/null ||
  die "$python cannot make a virtual environment: deploy/install-deps.sh installs python3-venv"
[ -f "$requirements" ] || die "$requirements is missing"

key=$({ cat "$requirements"; echo "$deepspeed"; "$python" -c 'import sys; print(sys.version)'; } |
  sha256sum | cut -c1-12)
cache="${STRATA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/strata}"
dir="$cache/hf-venv-$key"
stamp="$dir/.strata-hf-venv"
mkdir -p "$cache" "$(dirname "$link")"

check_imports() {
  "$dir/bin/python" -c 'import torch, transformers, tokenizers, safetensors, peft, deepspeed, tensorboard, pyarrow' \
    >/dev/null 2>&1
}

# One maker at a time (ctest may run the fixture from two build trees).
exec 9>"$cache/.hf-venv.lock"
flock 9

if [ ! -f "$stamp" ] || ! check_imports; then
  start=$(date +%s)
  echo "hf-venv: creating $dir (torch, transformers, peft, DeepSpeed from PyPI; several GB)" >&2
  rm -rf "$dir"
  "$python" -m venv "$dir" || die "cannot create a virtual environment in $dir"
  "$dir/bin/pip" install --quiet --disable-pip-version-check --no-deps -r "$requirements" ||
    die "pip install -r $requirements failed (is PyPI reachable? is there disk space in $cache?)"
  DS_BUILD_OPS=0 "$dir/bin/pip" install --quiet --disable-pip-version-check --no-deps \
    --no-build-isolation "$deepspeed" || die "pip install $deepspeed failed"
  check_imports || die "$dir: the installed packages do not import"
  "$dir/bin/python" - "$start" "$dir" <<'EOF' >&2
import sys, time, subprocess
import deepspeed, peft, safetensors, tokenizers, torch, transformers
size = subprocess.run(["du", "-sh", sys.argv[2]], capture_output=True, text=True).stdout.split()[0]
print(f"hf-venv: torch {torch.__version__}, transformers {transformers.__version__}, "
      f"tokenizers {tokenizers.__version__}, safetensors {safetensors.__version__}, "
      f"peft {peft.__version__}, deepspeed {deepspeed.__version__}: "
      f"made in {time.time() - float(sys.argv[1]):.0f} s, {size}")
EOF
  echo "$key" >"$stamp"
fi

# The link in the build tree; a directory left there by an older version of this script goes.
if [ -e "$link" ] && [ ! -L "$link" ]; then rm -rf "$link"; fi
ln -sfn "$dir" "$link"
echo "$link/bin/python" >&3
