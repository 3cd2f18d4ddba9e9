"""The frozen target's feature forward as one CUDA graph (`run.capture_target`).

Under per-layer compilation (the 8B preset) every step launched each target layer's kernels from
Python: about half of the thread's host work per step (63-66 ms without the graph, 33-35 ms with
it, on one H200 with a launch queue deep enough for a step), time that all worker threads share
through one GIL (docs/threaded-compile.md). The target has no gradients, fixed weights and, with
padded batches, one input shape, so its forward is captured once and replayed in one launch.
Nothing here knows of threads: the worker captures under its warm-up lock.
"""

from __future__ import annotations

import torch

from .target import Qwen3Target


class GraphedFeatures:
    """`target.features(input_ids, layer_ids)`, replayed from a CUDA graph captured for one input
    shape; any other shape or layer list runs the target eagerly."""

    def __init__(self, target: Qwen3Target, layer_ids: list[int] | tuple[int, ...], shape: tuple[int, int],
                 device: torch.device):
        self.target, self.layer_ids = target, tuple(layer_ids)
        self.static_ids = torch.zeros(shape, dtype=torch.long, device=device)  # [N, S], copied into per step
        # One eager call on a side stream first: lazy one-off work (cuBLAS/cuDNN handles and plans,
        # compiled layers' first-call set-up) must not land in the capture. PyTorch's capture recipe.
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            target.features(self.static_ids, self.layer_ids)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # A stream of this device (torch.cuda.graph's default one is made on whichever device asked
        # first); thread_local: the other workers are idle at the warm-up lock or the ready barrier.
        with torch.cuda.graph(self.graph, stream=torch.cuda.Stream(device), capture_error_mode="thread_local"):
            self.static_feats = target.features(self.static_ids, self.layer_ids)  # [N, S, L*H]

    def __call__(self, input_ids: torch.Tensor, layer_ids: list[int] | tuple[int, ...]) -> torch.Tensor:
        """The features of `input_ids` [N, S] -> [N, S, L*H]. Replayed, the result is the graph's
        own output buffer: the next call overwrites it, so it serves one step (its backward reads
        it before the next step's forward, in stream order)."""
        if input_ids.shape != self.static_ids.shape or tuple(layer_ids) != self.layer_ids:
            return self.target.features(input_ids, layer_ids)
        self.static_ids.copy_(input_ids)
        self.graph.replay()
        return self.static_feats
