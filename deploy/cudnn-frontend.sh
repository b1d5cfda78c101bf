#!/usr/bin/env bash
# Fetches the cuDNN frontend's headers (header-only C++, Apache-2.0) that Strata's fused attention
# is built against, from the pinned PyPI wheel `nvidia-cudnn-frontend`, and prints their include
# directory. Only the headers are used: cuDNN itself is loaded at run time (docs/gpu.md, "cuDNN").
#
#   deploy/cudnn-frontend.sh            # into $STRATA_CACHE_DIR (default ~/.cache/strata)
#   deploy/cudnn-frontend.sh --check    # prints the include directory if present; exit 1 if not
#
# CMake looks in the same place (STRATA_CUDNN_FRONTEND_DIR overrides it); without the headers the
# CUDA build leaves cuDNN's attention out and says so. deploy/install-deps.sh runs this script
# when a CUDA toolkit is installed.
set -euo pipefail

VERSION=1.32.0
# The wheel for CPython 3.12 on manylinux_2_28 x86_64; any of the release's wheels has the same
# headers. Its SHA-256, as PyPI lists it:
WHEEL_SHA256=8b354a8e550c083eb247f1eb39a7d69a4a269075f5a01e4fcbd2531680b17239

cache="${STRATA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/strata}"
dest="$cache/cudnn-frontend-$VERSION"
include="$dest/include"

die() {
  echo "cudnn-frontend: $*" >&2
  exit 1
}

if [ -f "$include/cudnn_frontend.h" ]; then
  echo "$include"
  exit 0
fi
[ "${1:-}" != --check ] || exit 1
[ $# -eq 0 ] || die "unknown argument '$1' (the only one is --check)"

# A pip to download with: the system Python's, else one in a throw-away virtual environment.
py=/usr/bin/python3
[ -x "$py" ] || py="$(command -v python3 || true)"
[ -n "$py" ] || die "no python3 to download the wheel with (deploy/install-deps.sh installs it)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
pip=("$py" -m pip)
if ! "${pip[@]}" --version >/dev/null 2>&1; then
  "$py" -m venv "$tmp/venv" >/dev/null 2>&1 ||
    die "$py has no pip and cannot make a virtual environment (install python3-venv)"
  pip=("$tmp/venv/bin/python" -m pip)
fi
echo "nvidia-cudnn-frontend==$VERSION --hash=sha256:$WHEEL_SHA256" >"$tmp/requirements.txt"
echo "cudnn-frontend: downloading nvidia-cudnn-frontend $VERSION (about 12 MB) for its headers" >&2
"${pip[@]}" download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --require-hashes -r "$tmp/requirements.txt" -d "$tmp/wheel" >&2 ||
  die "pip download of nvidia-cudnn-frontend==$VERSION failed (is PyPI reachable?)"
wheel="$(ls "$tmp"/wheel/nvidia_cudnn_frontend-"$VERSION"-*.whl 2>/dev/null | head -n 1)"
[ -n "$wheel" ] || die "pip reported success but left no wheel in $tmp/wheel"
"$py" - "$wheel" "$tmp/unpacked" <<'EOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    members = [m for m in z.namelist() if m.startswith("include/")]
    if not any(m == "include/cudnn_frontend.h" for m in members):
        sys.exit("the wheel has no include/cudnn_frontend.h")
    z.extractall(sys.argv[2], members)
EOF
mkdir -p "$cache"
rm -rf "$dest.partial"
mkdir -p "$dest.partial"
mv "$tmp/unpacked/include" "$dest.partial/include"
rm -rf "$dest"
mv "$dest.partial" "$dest"
echo "cudnn-frontend: headers in $include" >&2
echo "$include"
