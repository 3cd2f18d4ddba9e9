"""Checkpoints (safetensors weights + JSON meta + torch-saved optimizer state) and the stop flag
that turns SIGTERM/SIGINT into a clean save-and-exit."""

from __future__ import annotations

import base64
import json
import shutil
import signal
import threading
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

WEIGHTS, META, OPTIM = "drafter.safetensors", "meta.json", "optimizer.pt"


class StopFlag:
    """Records a termination signal; the training loop polls `requested` between steps."""

    def __init__(self):
        self.signum: int | None = None

    @property
    def requested(self) -> bool:
        """True once a signal arrived."""
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        """Shell convention for death by signal: 128 + signum (143 for SIGTERM)."""
        return 128 + (self.signum or 0)

    def install(self) -> None:
        """Catch SIGTERM and SIGINT (only possible from the main thread; a no-op elsewhere)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def request(self, signum: int) -> None:
        """Record a stop, as the signal handler does (the first signal's number is kept)."""
        if self.signum is None:
            self.signum = signum

    def _handle(self, signum, _frame) -> None:
        self.request(signum)


def _encode_state(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode()


def _decode_state(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def rng_state(device: torch.device) -> dict[str, str]:
    """Torch RNG states (CPU and the CUDA device, if any) as JSON-safe strings."""
    states = {"cpu": _encode_state(torch.get_rng_state())}
    if device.type == "cuda":
        states["cuda"] = _encode_state(torch.cuda.get_rng_state(device))
    return states


def restore_rng_state(states: dict[str, str], device: torch.device) -> None:
    """Inverse of `rng_state`."""
    torch.set_rng_state(_decode_state(states["cpu"]))
    if device.type == "cuda" and "cuda" in states:
        torch.cuda.set_rng_state(_decode_state(states["cuda"]), device)


def checkpoint_dir(out_dir: str | Path) -> Path:
    """Where a run keeps its checkpoints."""
    return Path(out_dir) / "checkpoints"


def save_checkpoint(
    out_dir: str | Path,
    step: int,
    drafter: torch.nn.Module,
    optimizer,
    scheduler,
    config: dict,
    device: torch.device,
    keep: int = 2,
) -> Path:
    """Write checkpoints/step_XXXXXXXX atomically (temp dir, then rename) and prune old ones."""
    root = checkpoint_dir(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp_step_{step:08d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file({k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}, str(tmp / WEIGHTS))
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp / OPTIM)
    meta = {"step": step, "config": config, "rng": rng_state(device)}
    (tmp / META).write_text(json.dumps(meta, indent=1))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in sorted(root.glob("step_*"))[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The newest complete checkpoint directory, or None."""
    found = sorted(p for p in checkpoint_dir(out_dir).glob("step_*") if (p / META).exists())
    return found[-1] if found else None


def load_checkpoint(path: str | Path, drafter: torch.nn.Module, optimizer, scheduler, device: torch.device) -> dict:
    """Restore weights, optimizer, scheduler and RNG in place; returns the meta dict."""
    path = Path(path)
    drafter.load_state_dict(load_file(str(path / WEIGHTS), device=str(device)))
    state = torch.load(path / OPTIM, map_location=device, weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    meta = json.loads((path / META).read_text())
    restore_rng_state(meta["rng"], device)
    return meta
