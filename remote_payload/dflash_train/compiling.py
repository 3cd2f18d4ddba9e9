"""What `torch.compile` does in the workers: the compile policy the run plan chose (plan.py), how
it wraps a function, and the background import of the compiler.

Why threads compile the way they do (and the measurements): docs/threaded-compile.md.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Inductor options for "cudagraphs": reduce-overhead's CUDA graphs without CUDAGraph Trees.
# Passed to every torch.compile call, never set in torch._inductor.config: from torch 2.12 config
# overrides are per-thread, so a value set by the main thread is not seen by the workers.
# Graph partitions off: the tree-less path treats every non-tangent backward input as a static
# address, which only holds when the whole forward is one captured graph (docs/threaded-compile.md).
CUDAGRAPH_OPTIONS = {"triton.cudagraphs": True, "triton.cudagraph_trees": False, "graph_partition": False}


@dataclass(frozen=True)
class CompilePolicy:
    """What `torch.compile` does in the workers, and why; chosen by `plan.resolve_run` with the
    scope and the CUDA graph captures that follow from it (the replica reads them, deciding nothing)."""

    requested: str
    effective: str  # off | default | cudagraphs
    options: dict[str, Any] | None
    reason: str
    scope: str = "step"  # step | drafter | layers (run.compile_scope, resolved)
    capture_target: bool = False  # run.capture_target resolved: the target's forward as one CUDA graph
    capture_optimizer: bool = False  # run.capture_optimizer resolved: clip + AdamW + zero as one CUDA graph

    def compile(self, fn: Callable) -> Callable:
        """Wrap a module or function according to the policy (under CUDA graphs, a function gets a
        compiled graph of its own: see `private_code`)."""
        if self.effective == "off":
            return fn
        import torch  # here: the policy itself is chosen by the pre-flight, which does not import torch

        if self.effective == "default":
            return torch.compile(fn)
        if isinstance(fn, torch.nn.Module):
            module = fn
            fn = lambda *args, **kwargs: module(*args, **kwargs)  # noqa: E731 - a function to copy
        # CUDA graphs replay fixed shapes: static shapes avoid a dynamic-shape graph that would be
        # re-captured (outside the warm-up lock) whenever a new size shows up.
        return torch.compile(private_code(fn), dynamic=False, options=dict(self.options))


EAGER = CompilePolicy("off", "off", None, "eager")


def private_code(fn: Callable) -> Callable:
    """`fn` with a code object of its own, so that Dynamo, which caches compiled graphs per code
    object, compiles it apart from every other copy.

    Two replicas on one GPU build their step from the same closure code; guards do not tell their
    (equal-shaped, same-device) parameters apart, so the second would replay the first one's CUDA
    graph, whose static inputs are the first replica's parameters: tree-less cudagraphify then
    fails with `dst.data_ptr() == src.data_ptr()` (compile_fx.py, torch 2.11). With a code object
    each, every replica captures its own graph (a warm FX cache keeps the second compile short)."""
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__, copy.__qualname__ = fn.__kwdefaults__, fn.__qualname__
    return copy


def preload_compiler() -> None:
    """Import Dynamo and Inductor in a background thread: the first `torch.compile` pays for it
    otherwise, in the worker, after everything else (7.7 s of the 8B preset's start-up on an H200
    box with a cold page cache, bench/startup_profile.py). Started before the config, data,
    CUDA context and weights are set up, it overlaps them; a worker that compiles first waits on
    the import lock."""

    def load() -> None:
        import torch  # noqa: F401
        import torch._dynamo  # noqa: F401
        import torch._inductor.compile_fx  # noqa: F401

    threading.Thread(target=load, name="dflash-preload-compiler", daemon=True).start()
