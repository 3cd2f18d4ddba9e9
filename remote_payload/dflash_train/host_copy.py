"""Copies of a training state in host memory, for a checkpoint that is written while training goes on.

The buffers are kept between checkpoints and reused while the state's tensors keep their shapes:
at 8B scale they are 12.6 GB, too much to allocate (and, for a CUDA source, pin) at every checkpoint.
They are pinned for a CUDA source, so that the device-to-host copy runs at full bandwidth: mapped
with transparent huge pages and registered with CUDA (cudaHostRegister), not taken from torch's
pinned allocator. On an H200 box, 12.6 GB took 6.6 s to pin there and added 2.2 s to the process's
exit (the unpinning of 3 million 4 KiB pages, which a stop waits for); on huge pages, 0.6 s and
0.35 s (bench/stop_bench.py)."""

from __future__ import annotations

import copy
import mmap
from collections.abc import Callable, Iterator
from typing import Any

import torch

# Tensors are packed into arenas of this size (a larger tensor gets one of its own). Each arena is one
# pinning call, during which the training thread's launches wait (session 17's H200, torch's
# allocator: 1 GiB arenas, ~0.45 s each, stalled the 8B steps 11-20 by 5.3-6.5 s in all); 256 MiB
# holds the 8B drafter's MLP weights (201 MB in fp32) whole.
ARENA_BYTES = 2**28
ALIGN = 64  # every tensor starts at a multiple of this, so any dtype can view its bytes
PORTABLE = 1  # cudaHostRegisterPortable: pinned for every device's context, not only the current one


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


def with_tensors(tree: Any, tensors: Iterator[torch.Tensor]) -> Any:
    """`tree` rebuilt with its tensors taken in order from `tensors` and its other values deep-copied
    (the scheduler's lists are the live ones, which training would go on changing)."""
    if isinstance(tree, torch.Tensor):
        return next(tensors)
    if isinstance(tree, dict):
        return {key: with_tensors(value, tensors) for key, value in tree.items()}
    if isinstance(tree, list):
        return [with_tensors(value, tensors) for value in tree]
    if isinstance(tree, tuple):
        return tuple(with_tensors(value, tensors) for value in tree)
    return copy.deepcopy(tree)


class HostBuffers:
    """Host memory that states are copied into, allocated on the first copy and whenever the
    state's tensors change shape or dtype."""

    def __init__(self):
        self.layout: list[tuple[torch.Size, torch.dtype]] = []  # the tensors the buffers fit
        self.views: list[torch.Tensor] = []  # one per tensor, in `tensors_of` order
        self.pinned: list[int] = []  # the addresses of the arenas registered with CUDA

    @property
    def nbytes(self) -> int:
        """The bytes the buffers hold."""
        return sum(v.nbytes for v in self.views)

    def reserve(self, state: Any, device: torch.device, pause: Callable[[], object] | None = None) -> None:
        """Allocate buffers that fit `state` (its tensors' shapes and dtypes) before the first copy:
        from another thread while training goes on, so that the copy finds them, calling `pause`
        between arenas for the training thread to catch up on the launches each one held up."""
        layout = [(t.shape, t.dtype) for t in tensors_of(state)]
        if layout != self.layout:
            self.release()
            self.views, self.pinned = _allocate(layout, pin=device.type == "cuda", pause=pause)
            self.layout = layout

    def release(self) -> None:
        """Unpin the buffers (they stay valid for any view still held, as pageable memory)."""
        for address in self.pinned:
            torch.cuda.cudart().cudaHostUnregister(address)
        self.pinned = []

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
        return with_tensors(state, iter(self.views)), allocated


def _arena(size: int, pin: bool) -> tuple[torch.Tensor, int | None]:
    """`size` bytes of host memory, and its address if it was pinned: an anonymous mapping on
    transparent huge pages where the kernel has them, registered with CUDA."""
    if not pin:
        return torch.empty(size, dtype=torch.uint8), None
    area = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        area.madvise(mmap.MADV_HUGEPAGE)
    memory = torch.frombuffer(area, dtype=torch.uint8)  # keeps the mapping alive
    error = int(torch.cuda.cudart().cudaHostRegister(memory.data_ptr(), size, PORTABLE))
    if error:
        raise RuntimeError(f"cudaHostRegister of {size / 1e9:.2f} GB of host memory failed (CUDA error {error})")
    return memory, memory.data_ptr()


def _allocate(
    layout: list[tuple[torch.Size, torch.dtype]], pin: bool, pause: Callable[[], object] | None = None
) -> tuple[list[torch.Tensor], list[int]]:
    """One contiguous tensor per (shape, dtype), packed into as few arenas as the sizes allow, and
    the addresses of the arenas pinned. Each tensor has a storage of its own over its bytes of an
    arena (torch.frombuffer), so that whoever writes a tensor's storage writes only its bytes."""
    spans, arenas, used, room = [], [], 0, 0  # spans: (arena index, offset, nbytes)
    for shape, dtype in layout:
        nbytes = shape.numel() * dtype.itemsize
        if not arenas or used + nbytes > room:
            arenas.append(0)
            used = 0
            room = max(ARENA_BYTES, nbytes)
        spans.append((len(arenas) - 1, used, nbytes))
        used += -(-nbytes // ALIGN) * ALIGN
        arenas[-1] = max(arenas[-1], used)
    memory, pinned = [], []
    for size in arenas:
        if memory and pause is not None:
            pause()
        arena, address = _arena(size, pin)
        memory.append(arena.numpy())
        pinned += [address] if address is not None else []
    views = [
        torch.frombuffer(memory[arena], dtype=dtype, count=shape.numel(), offset=offset).view(shape)
        if nbytes
        else torch.empty(shape, dtype=dtype)
        for (arena, offset, nbytes), (shape, dtype) in zip(spans, layout)
    ]
    return views, pinned
