"""The installed torch and the GPUs it will see, found without importing it.

`import torch` costs 2-5 s of CPU on a box whose torch has compiled bytecode and 6-13 s on one
without; the pre-flight that `dflashctl train` runs before every start needs only torch's version,
whether it is a CUDA build, and the GPU count, so it reads `torch/version.py` (a generated file of
constants) and asks the CUDA driver for the count, as the CUDA runtime under torch does (the
driver applies CUDA_VISIBLE_DEVICES). Standard library only.
"""

from __future__ import annotations

import ast
import ctypes
import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TorchBuild:
    """torch.__version__, torch.version.cuda and torch.version.hip of the installed torch."""

    version: str
    cuda: str | None
    hip: str | None


@functools.cache
def installed() -> TorchBuild:
    """The installed torch's build, read from its version.py (ModuleNotFoundError when none is)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("No module named 'torch'", name="torch")
    return read_build(Path(next(iter(spec.submodule_search_locations)), "version.py"))


def read_build(version_py: Path) -> TorchBuild:
    """The constants of a torch `version.py` (`__version__ = '2.11.0+cu130'`, `cuda: Optional[str] = '13.0'`)."""
    found = {}
    for node in ast.parse(version_py.read_text()).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name) and isinstance(node.value, ast.Constant):
                    found[target.id] = node.value.value
    return TorchBuild(str(found["__version__"]), found.get("cuda"), found.get("hip"))


def driver_gpu_count() -> int | None:
    """The GPUs the CUDA driver shows this process (CUDA_VISIBLE_DEVICES applied): 0 when it finds
    none, None when there is no driver library to ask."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    if driver.cuInit(0) != 0:  # e.g. CUDA_ERROR_NO_DEVICE: every GPU hidden, or none present
        return 0
    count = ctypes.c_int(0)
    return count.value if driver.cuDeviceGetCount(ctypes.byref(count)) == 0 else 0


def visible_gpus() -> int:
    """How many GPUs torch will see here: none for a CPU build, the driver's count for a CUDA build
    (torch's own answer where the driver library cannot be loaded here, and for ROCm builds)."""
    build = installed()
    if build.cuda is None and build.hip is None:
        return 0
    if build.hip is None:
        count = driver_gpu_count()
        if count is not None:
            return count
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
