"""The frozen target's feature forward as one CUDA graph (`run.capture_target`).

Under per-layer compilation (the 8B preset) every step launched each target layer's kernels from
Python: about half of the thread's host work per step (63-66 ms without the graph, 33-35 ms with
it, on one H200 with a launch queue deep enough for a step), time that all worker threads share
through one GIL (docs/threaded-compile.md). The target has no gradients, fixed weights and, with
padded batches, one input shape, so its forward is captured once and replayed in one launch.
The worker captures it under its warm-up lock (`workers.capture_graph`).
"""

from __future__ import annotations

import torch

from .target import Qwen3Target
from .workers import capture_graph


class GraphedFeatures:
    """`target.features(input_ids, layer_ids)`, replayed from a CUDA graph captured for one input
    shape; any other shape or layer list runs the target eagerly."""

    def __init__(
        self, target: Qwen3Target, layer_ids: list[int] | tuple[int, ...], shape: tuple[int, int], device: torch.device
    ):
        self.target, self.layer_ids = target, tuple(layer_ids)
        self.static_ids = torch.zeros(shape, dtype=torch.long, device=device)  # [N, S], copied into per step

        def forward() -> torch.Tensor:
            return target.features(self.static_ids, self.layer_ids)  # [N, S, L*H]

        # One eager call first (cuBLAS/cuDNN handles and plans, the compiled layers' first-call set-up).
        self.graph, self.static_feats = capture_graph(device, forward, forward)

    def __call__(self, input_ids: torch.Tensor, layer_ids: list[int] | tuple[int, ...]) -> torch.Tensor:
        """The features of `input_ids` [N, S] -> [N, S, L*H]. Replayed, the result is the graph's
        own output buffer: the next call overwrites it, so it serves one step (its backward reads
        it before the next step's forward, in stream order)."""
        if input_ids.shape != self.static_ids.shape or tuple(layer_ids) != self.layer_ids:
            return self.target.features(input_ids, layer_ids)
        self.static_ids.copy_(input_ids)
        self.graph.replay()
        return self.static_feats
