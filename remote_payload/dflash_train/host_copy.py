"""Copies of a training state in host memory, for a checkpoint that is written while training goes on.

The buffers are kept between checkpoints and reused while the state's tensors keep their shapes:
at 8B scale they are 12.6 GB, too much to allocate (and, for a CUDA source, pin) at every checkpoint.
They are pinned for a CUDA source, so that the device-to-host copy runs at full bandwidth."""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from typing import Any

import torch

# The pinned allocator rounds every allocation up to a power of two: tensors are packed into arenas
# of this size rather than allocated one by one (which could waste up to half of the 12.6 GB). Each
# arena is one pinning call, during which the training thread's launches wait (session 17's H200: 1
# GiB arenas, ~0.45 s each, stalled the 8B steps 11-20 by 5.3-6.5 s in all); 256 MiB holds the 8B
# drafter's MLP weights (201 MB in fp32) whole, and a larger tensor (its 335 MB fc) gets its own.
ARENA_BYTES = 2**28
ALIGN = 64  # every tensor starts at a multiple of this, so any dtype can view its bytes


def tensors_of(tree: Any) -> Iterator[torch.Tensor]:
    """The tensors of a nested state (dicts, lists, tuples), in a fixed order."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from tensors_of(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from tensors_of(value)


def _replaced(tree: Any, tensors: Iterator[torch.Tensor]) -> Any:
    """`tree` rebuilt with its tensors taken in order from `tensors` and its other values deep-copied
    (the scheduler's lists are the live ones, which training would go on changing)."""
    if isinstance(tree, torch.Tensor):
        return next(tensors)
    if isinstance(tree, dict):
        return {key: _replaced(value, tensors) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_replaced(value, tensors) for value in tree]
    if isinstance(tree, tuple):
        return tuple(_replaced(value, tensors) for value in tree)
    return copy.deepcopy(tree)


class HostBuffers:
    """Host memory that states are copied into, allocated on the first copy and whenever the
    state's tensors change shape or dtype."""

    def __init__(self):
        self.layout: list[tuple[torch.Size, torch.dtype]] = []  # the tensors the buffers fit
        self.views: list[torch.Tensor] = []  # one per tensor, in `tensors_of` order

    @property
    def nbytes(self) -> int:
        """The bytes the buffers hold."""
        return sum(v.nbytes for v in self.views)

    def reserve(self, state: Any, device: torch.device, pause_s: float = 0.0) -> None:
        """Allocate buffers that fit `state` (its tensors' shapes and dtypes) before the first copy:
        from another thread while training goes on, so that the copy finds them, with `pause_s`
        between arenas for the training thread to catch up on the launches each one held up."""
        layout = [(t.shape, t.dtype) for t in tensors_of(state)]
        if layout != self.layout:
            self.views = _allocate(layout, pin=device.type == "cuda", pause_s=pause_s)
            self.layout = layout

    def copy(self, state: Any, device: torch.device) -> tuple[Any, bool]:
        """`state` with every tensor replaced by its copy here, complete when this returns (the
        caller may change the originals at once), and whether the buffers were allocated for it."""
        sources = list(tensors_of(state))
        allocated = [(t.shape, t.dtype) for t in sources] != self.layout
        self.reserve(state, device)
        cuda = device.type == "cuda"
        for dst, src in zip(self.views, sources):
            dst.copy_(src, non_blocking=cuda)
        if cuda:
            # The copies were queued after the step's kernels (this thread's stream); every stream of
            # the device is waited for, so nothing of the step is still writing what was copied.
            torch.cuda.synchronize(device)
        return _replaced(state, iter(self.views)), allocated


def _allocate(layout: list[tuple[torch.Size, torch.dtype]], pin: bool, pause_s: float = 0.0) -> list[torch.Tensor]:
    """One contiguous tensor per (shape, dtype), packed into as few arenas as the sizes allow. Each
    has a storage of its own over its bytes of an arena (torch.frombuffer): torch.save writes a
    tensor's whole storage, and a view of an arena would write the arena."""
    spans, arenas, used, room = [], [], 0, 0  # spans: (arena index, offset, nbytes)
    for shape, dtype in layout:
        nbytes = shape.numel() * dtype.itemsize
        if not arenas or used + nbytes > room:
            arenas.append(0)
            used = 0
            # What the allocator will give: a power of two, so a tensor larger than ARENA_BYTES leaves
            # room in its arena for the tensors after it.
            room = max(ARENA_BYTES, 1 << max(nbytes - 1, 0).bit_length())
        spans.append((len(arenas) - 1, used, nbytes))
        used += -(-nbytes // ALIGN) * ALIGN
        arenas[-1] = max(arenas[-1], used)
    memory = []
    for size in arenas:
        if memory and pause_s:
            time.sleep(pause_s)
        memory.append(torch.empty(size, dtype=torch.uint8, pin_memory=pin).numpy())
    return [
        torch.frombuffer(memory[arena], dtype=dtype, count=shape.numel(), offset=offset).view(shape)
        if nbytes
        else torch.empty(shape, dtype=dtype)
        for (arena, offset, nbytes), (shape, dtype) in zip(spans, layout)
    ]
