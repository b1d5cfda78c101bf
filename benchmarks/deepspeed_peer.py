"""deepspeed_peer.py: what the DeepSpeed comparisons (adam_vs_deepspeed.py, aio_vs_deepspeed.py)
share: the prelude of the worker processes that build and load DeepSpeed's ops with its own op
builder, the check that this python has DeepSpeed, and writing the result.

DeepSpeed (0.19.8, pinned) comes from deploy/hf-venv.sh, over PyPI's torch 2.15.
"""
import json
import sys
from importlib import metadata

try:
    DEEPSPEED_VERSION = metadata.version("deepspeed")
except metadata.PackageNotFoundError:  # has_deepspeed() says what to do
    DEEPSPEED_VERSION = "(not installed)"


def worker_prelude(builder, add_o3):
    """Python source that a worker runs first: torch's CUDA_HOME cleared (the op builder must
    build the CPU op only: the comparisons are on the CPU, and a machine without a GPU cannot
    build DeepSpeed's CUDA variants) and, with add_o3, `builder`'s compiler flags prefixed with
    -O3 (DeepSpeed's builders add their -O3 only on their CUDA path)."""
    lines = ["import torch.utils.cpp_extension as ce",
             "ce.CUDA_HOME = None",
             f"from deepspeed.ops.op_builder import {builder}"]
    if add_o3:
        lines += [f"_plain_cxx_args = {builder}.cxx_args",
                  f"{builder}.cxx_args = lambda self: ['-O3'] + _plain_cxx_args(self)"]
    return "\n".join(lines) + "\n"


def has_deepspeed(tool):
    """True when this python imports deepspeed; else says to use the venv's python."""
    try:
        import deepspeed  # noqa: F401
        return True
    except ImportError as e:
        print(f"{tool}: this python ({sys.executable}) cannot import deepspeed ({e}); run it with "
              "the python of deploy/hf-venv.sh", file=sys.stderr)
        return False


def emit(out, path):
    """The result: one JSON line on stdout, and in `path` when given."""
    text = json.dumps(out)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
