"""The training recipe a real target gets by default: the fields the `real-target` preset leaves
unset (None), filled from the target's size by `resolve.fill_config`, each with its reason.

Where the values come from is in docs/quality.md, with the table of recipes tried on the quality
bench (a real-structure target) and what each gave in tau per GPU-minute; change them there first.
"""

from __future__ import annotations

from dataclasses import dataclass

# From this target width up, the shapes of z-lab's published drafters for Qwen3-4B/8B: 5 draft
# layers over 3,072-token sequences, 512 anchors each, one sequence per GPU (the 8B preset's shapes,
# which fit one H200 at 215 ms/step: docs/performance.md).
LARGE_TARGET_HIDDEN = 2048
# Epochs over the training rows when neither run.steps nor run.epochs is given: issue 26's two H200
# runs (~12 epochs each) were still gaining tau; the bench's 8,192-row run had flattened by ~8.
DEFAULT_EPOCHS = 10


@dataclass(frozen=True)
class Recipe:
    """Defaults for one target size class; `reason` says where they come from."""

    num_layers: int
    max_length: int
    anchors_per_seq: int
    batch_size: int
    reason: str


def recipe_for_target(hidden_size: int) -> Recipe:
    """The drafter depth and data shapes for a real target of this width."""
    if hidden_size >= LARGE_TARGET_HIDDEN:
        return Recipe(
            5,
            3072,
            512,
            1,
            f"target hidden size {hidden_size} >= {LARGE_TARGET_HIDDEN}: the shapes of "
            f"z-lab's published Qwen3-4B/8B drafters",
        )
    return Recipe(
        3,
        512,
        64,
        16,
        f"target hidden size {hidden_size} < {LARGE_TARGET_HIDDEN}: the shapes that reached "
        f"tau 5.21 on a 95M target on an H200 (docs/quality.md)",
    )
