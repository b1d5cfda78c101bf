"""Helpers of the scripts that run strata train on several ranks (resume_ranks.py, eval_ranks.py,
tp_ranks.py): a command that must succeed, and a metrics file's losses."""
import json
import subprocess
import sys


def run(cmd, timeout=300):
    """Runs cmd (printed first) and returns its output; exits naming the code when it fails."""
    print("+", " ".join(cmd), flush=True)
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=timeout)
    if r.returncode != 0:
        print(r.stdout)
        sys.exit(f"command failed with exit code {r.returncode}")
    return r.stdout


def losses(path):
    """{step: loss} from a --metrics JSON-lines file."""
    with open(path) as f:
        return {json.loads(line)["step"]: json.loads(line)["loss"] for line in f if line.strip()}
