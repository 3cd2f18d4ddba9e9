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
# Epochs over the training rows when neither run.steps nor run.epochs is given: on the quality bench
# (docs/quality.md) runs of 9-12 epochs generalised (held-out loss 0.84-0.87) and 37 epochs of 16,384
# rows memorised them (2.25, tau down to prompt lookup's); twice the rows at 9.3 epochs gave the best tau.
DEFAULT_EPOCHS = 10
# A run on a real target asking for more epochs than this is told that more rows would serve it better.
MANY_EPOCHS = 2 * DEFAULT_EPOCHS
# In-training evaluations of a real-target run with run.eval_every unset (the final one comes on top).
# Each decodes 16 held-out prompts x 64 tokens speculatively: seconds of GPU time (1.6-3.0 s on the
# quality bench's 95M target; at the 8B shape ~1,000 speculative steps of ~7.3 ms while tau is near 1,
# ~200 at tau 5). Every 100 steps, the tiny preset's cadence, that would be most of a small target's
# run (steps of 5-30 ms) and 8-25% of an 8B one's (100 steps of 0.22 s).
EVALUATIONS = 10
# Checkpoints of a real-target run with run.checkpoint_every unset: as often as evaluations, and at
# least every this many steps (~4 minutes at the 8B shape on one H200). Every 100 steps an 8B run
# would write its 12.6 GB state every 22 s: 2 TB an hour, more than a SATA disk can flush in time.
CHECKPOINT_STEPS = 1000


def epochs_note(steps: int, steps_per_epoch: int) -> str | None:
    """A start-up line when `steps` repeat a real target's rows more than MANY_EPOCHS times, else None."""
    epochs = steps / steps_per_epoch
    if epochs <= MANY_EPOCHS:
        return None
    return (
        f"run length: {steps} steps = {epochs:.0f} epochs of {steps_per_epoch} batches; on the quality bench "
        f"37 epochs memorised the rows where ~10 epochs of twice the rows reached 1.4x the tau "
        f"(docs/quality.md): regenerate more prompts, or set run.epochs={DEFAULT_EPOCHS}"
    )


def cadence_for(steps: int, log_every: int) -> tuple[int, int]:
    """(eval_every, checkpoint_every) for a real-target run of `steps` steps: EVALUATIONS
    evaluations, checkpoints as often and at least every CHECKPOINT_STEPS; multiples of log_every,
    so that they fall on steps that sync anyway."""
    eval_every = -(-steps // (EVALUATIONS * log_every)) * log_every
    return eval_every, min(eval_every, max(log_every, CHECKPOINT_STEPS // log_every * log_every))


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
    # Batch 32, not 16: a 95M target's step is launch-bound, so twice the sequences cost 1.58x the
    # step time; on the quality bench that gave 1.22x the tau in the same training minutes.
    return Recipe(
        3,
        512,
        64,
        32,
        f"target hidden size {hidden_size} < {LARGE_TARGET_HIDDEN}: the shapes that reached "
        f"tau 5.66 on a 95M target on an H200, and batch 32 for 1.22x the tau of 16 per "
        f"training minute (docs/quality.md)",
    )
