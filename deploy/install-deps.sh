#!/usr/bin/env bash
# Installs every Debian package Strata needs to build, test and benchmark. Idempotent: packages
# already installed are left alone, and apt-get runs only when something is missing.
#
#   deploy/install-deps.sh            # as root, or with sudo available
#   deploy/install-deps.sh --build-only   # only what building and running strata needs (the
#                                         # container image, deploy/docker/Dockerfile)
#   STRATA_DEPS_DRY_RUN=1 deploy/install-deps.sh   # print what would be installed
#
# Not installed here: the CUDA toolkit and NCCL (from NVIDIA's repositories or images). CMake
# detects them when present (nvcc on PATH or in /usr/local/cuda) and builds the CUDA targets;
# without them everything else builds and passes. With a toolkit, this also fetches the cuDNN
# frontend's headers (deploy/cudnn-frontend.sh; cuDNN itself is found at run time).
set -euo pipefail

packages=(
  # toolchain
  build-essential cmake ninja-build pkg-config git
  # libraries
  liburing-dev          # io_uring
  libhwloc-dev          # NUMA placement of I/O threads
  libxxhash-dev         # checksums of offloaded data and checkpoints
  libspdlog-dev libfmt-dev
  nlohmann-json3-dev    # configuration
  libcli11-dev          # the strata command line
  libopenmpi-dev openmpi-bin  # multi-rank runs (optional at build time)
  libopenblas-dev       # CPU GEMMs (the overlap benchmark's compute; the CPU model kernels)
)
test_packages=(
  # tests and benchmarks
  libgtest-dev libgmock-dev libbenchmark-dev
  clang                 # the thread-safety preset (-Wthread-safety) and the fuzz preset
  fio                   # benchmarks/nvme_vs_fio.py compares against it
  python3               # benchmark scripts
  python3-torch         # the PyTorch reference (oracle) the model tests compare against
  python3-venv          # deploy/hf-venv.sh: torch, transformers, peft and DeepSpeed from PyPI
  libaio-dev            # DeepSpeed's async I/O op (benchmarks/aio_vs_deepspeed.py)
  chromium python3-pil  # the test that renders `strata report` in a headless browser
  slurm-wlm munge       # the test that runs deploy/slurm/strata-train.sbatch on a real Slurm
  docker.io debootstrap # the test that builds deploy/docker/Dockerfile and runs the synthetic job in it
)

case "${1:-}" in
  "") packages+=("${test_packages[@]}") ;;
  --build-only) ;;
  *) echo "install-deps: unknown argument '$1' (the only one is --build-only)" >&2; exit 2 ;;
esac

# With a CUDA toolkit: the cuDNN frontend's headers (PyPI, pinned; not a Debian package), for the
# CUDA build's fused attention. Without them that build leaves cuDNN's attention out and says so.
cudnn_frontend() {
  if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
    "$(dirname "${BASH_SOURCE[0]}")/cudnn-frontend.sh" >/dev/null ||
      echo "install-deps: warning: the cuDNN frontend's headers could not be fetched; CUDA builds will use Strata's own attention kernels" >&2
  fi
}

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages are installed"
  [ -n "${STRATA_DEPS_DRY_RUN:-}" ] || cudnn_frontend
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
if [ -n "${STRATA_DEPS_DRY_RUN:-}" ]; then
  exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
  sudo=()
elif command -v sudo >/dev/null 2>&1; then
  sudo=(sudo)
else
  echo "install-deps: need root (or sudo) to install: ${missing[*]}" >&2
  exit 1
fi

export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -q
"${sudo[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
cudnn_frontend
echo "install-deps: done"
