"""Remote side of `dflashctl hosts check`: one JSON object describing this interpreter and its GPUs.

Runs inside the container as `python -c <this source>` (stdlib only, Python 3.8+). torch is
probed in a child process with a time limit, so a torch that hangs or crashes on import still
leaves an answer about the interpreter itself.
"""

import json
import os
import platform
import shutil
import subprocess
import sys

TORCH_TIMEOUT_S = 120
SMI_TIMEOUT_S = 30

# Printed as one JSON line by the child interpreter.
TORCH_PROBE = r"""
import json
info = {}
try:
    import torch
    info["torch"] = torch.__version__
    info["cuda_available"] = bool(torch.cuda.is_available())
    info["cuda_version"] = torch.version.cuda
    info["gpu_count"] = torch.cuda.device_count() if info["cuda_available"] else 0
    info["gpu_names"] = [torch.cuda.get_device_name(i) for i in range(info["gpu_count"])]
except Exception as exc:
    info["torch_error"] = "%s: %s" % (type(exc).__name__, exc)
try:
    import triton
    info["triton"] = triton.__version__
except Exception as exc:
    info["triton_error"] = "%s: %s" % (type(exc).__name__, exc)
# What the trainer imports besides torch (safetensors writes through numpy).
info["packages"] = {}
for name in ("numpy", "safetensors", "yaml"):
    try:
        info["packages"][name] = getattr(__import__(name), "__version__", "?")
    except Exception as exc:
        info["packages"][name] = None
print(json.dumps(info))
"""


def probe_torch():
    """torch/triton versions and CUDA facts from a child interpreter, or an error description."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", TORCH_PROBE],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            timeout=TORCH_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return {"torch_error": "import torch took more than %d s" % TORCH_TIMEOUT_S}
    lines = done.stdout.decode("utf-8", "replace").strip().splitlines()
    if done.returncode != 0 or not lines:
        err = done.stderr.decode("utf-8", "replace").strip().splitlines()
        return {"torch_error": "probe exited %d: %s" % (done.returncode, err[-1] if err else "no output")}
    return json.loads(lines[-1])


def probe_nvidia_smi():
    """GPUs as nvidia-smi lists them, or None when nvidia-smi is not installed."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    query = "--query-gpu=index,name,memory.total,memory.used,utilization.gpu"
    try:
        done = subprocess.run(
            [smi, query, "--format=csv,noheader,nounits"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            timeout=SMI_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return {"error": "nvidia-smi took more than %d s" % SMI_TIMEOUT_S}
    if done.returncode != 0:
        err = (done.stdout + done.stderr).decode("utf-8", "replace").strip().splitlines()
        return {"error": err[-1] if err else "nvidia-smi exited %d" % done.returncode}
    gpus = []
    for line in done.stdout.decode("utf-8", "replace").splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 5:
            gpus.append(dict(zip(("index", "name", "memory_total_mib", "memory_used_mib", "utilization_pct"), fields)))
    return {"gpus": gpus}


def main():
    """Print the JSON description: Python version, executable, cwd, torch probe and nvidia-smi GPUs."""
    info = {
        "python": platform.python_version(),
        "executable": sys.executable,
        "cwd": os.getcwd(),
    }
    info.update(probe_torch())
    info["nvidia_smi"] = probe_nvidia_smi()
    print(json.dumps(info))


if __name__ == "__main__":
    main()
