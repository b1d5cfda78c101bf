"""Helpers of the scripts that run strata train on several ranks (resume_ranks.py, eval_ranks.py,
tp_ranks.py): a command that must succeed, a metrics file's losses, and the tiny ZeRO-3 NVMe
config two of them train with."""
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


def write_nvme_config(path, nvme, tensor_parallel=1):
    """ZeRO-3 with parameters and optimizer states in `nvme`, clipping, a warm-up cosine schedule,
    a global batch of 8 (2 per rank), and tensor_parallel.autotp_size when above 1."""
    config = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.004, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"warmup_num_steps": 2, "total_num_steps": "auto"}},
        "zero_optimization": {
            "stage": 3, "sub_group_size": 4096,
            "offload_param": {"device": "nvme", "nvme_path": nvme},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme},
        },
    }
    if tensor_parallel > 1:
        config["tensor_parallel"] = {"autotp_size": tensor_parallel}
    with open(path, "w") as f:
        json.dump(config, f)
