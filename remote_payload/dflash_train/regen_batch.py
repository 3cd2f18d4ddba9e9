"""The builtin regen engine's default batch: the largest that fits the GPU's memory, up to
MAX_AUTO_BATCH. A step reads the whole target at any batch (5.4 ms at batch 1, 7.1 ms at 64 at the
Qwen3-8B shape on an H200), so output tokens/s grow with the batch until the KV cache fills the
memory: there batch 32 (the old fixed default) wrote 4,999 tok/s, 64 8,434-8,449, 128 12,446
(docs/performance.md, runs 31-32) and 256 14,904 (run 36). The rule reads only the GPU's total memory and the target's
config, never its free memory, so a resumed run on the same machine gets the same batches and
seeds as the run it continues. Standard library only (the device memory is handed in)."""

from __future__ import annotations

from pathlib import Path

from .config import TargetConfig

# Run 32: 128 wrote 1.47x batch 64's rate, run 36: 256 another 1.21x. The prefill runs in row groups of
# decode.PREFILL_TOKENS, so its activations do not grow with the batch: only the KV cache does.
MAX_AUTO_BATCH = 256
# A transformers target (target_hf.HFDecoder) prefills every row at once into the model's own cache:
# its batch stays where it was before the grouped prefill.
MAX_AUTO_BATCH_TRANSFORMERS = 128
PROMPT_ALLOWANCE = 1024  # prompt tokens planned per row; longer prompts make a larger cache
CAPACITY_STEP = 1024  # cache positions are allocated in steps of this: fewer decoder shapes, each warmed up once
MEMORY_SHARE = 0.85  # of the total memory: the rest for the CUDA context, other processes' slack
OVERHEAD_BYTES = 3 << 30  # step graphs, compiled kernels' workspaces, logits, the allocator's slack
CPU_BATCH = 32  # no device memory to size from; the tiny CPU targets decode 32 rows quickly

DTYPE_BYTES = {"bf16": 2, "fp32": 4}


def cache_capacity(need: int, limit: int) -> int:
    """Cache positions for `need` of them: rounded up to CAPACITY_STEP, at most the target's context."""
    return min(limit, -(-need // CAPACITY_STEP) * CAPACITY_STEP)


def weight_bytes(t: TargetConfig, dtype_bytes: int) -> int:
    """The target's weights in memory: its safetensors files (an upper bound when they are stored
    wider than they are loaded), else a count from its shape (a random target)."""
    if t.path is not None:
        files = sorted(Path(t.path).glob("*.safetensors"))
        if files:
            return sum(f.stat().st_size for f in files)
    q, kv = t.num_heads * t.head_dim, t.num_kv_heads * t.head_dim
    if t.num_experts:
        mlp = t.num_experts * 3 * t.hidden_size * t.moe_intermediate_size + t.hidden_size * t.num_experts
    else:
        mlp = 3 * t.hidden_size * t.intermediate_size
    per_layer = t.hidden_size * (2 * q + 2 * kv) + mlp
    embeddings = t.vocab_size * t.hidden_size * (1 if t.tie_word_embeddings else 2)
    return (t.num_layers * per_layer + embeddings) * dtype_bytes


def cache_bytes_per_position(t: TargetConfig, dtype_bytes: int) -> int:
    """One row's K and V at one position, over every layer."""
    return 2 * t.num_layers * t.num_kv_heads * t.head_dim * dtype_bytes


def auto_batch(t: TargetConfig, dtype: str, max_new_tokens: int, total_bytes: int | None) -> tuple[int, str]:
    """(the batch, why): the largest power of two up to MAX_AUTO_BATCH (MAX_AUTO_BATCH_TRANSFORMERS
    for a transformers target) whose KV cache fits beside the weights in MEMORY_SHARE of
    `total_bytes` (the smallest GPU's; None: CPU)."""
    if total_bytes is None:
        return CPU_BATCH, f"auto: {CPU_BATCH} on CPU"
    size = DTYPE_BYTES[dtype]
    capacity = cache_capacity(PROMPT_ALLOWANCE + max_new_tokens, t.max_position_embeddings)
    per_row = capacity * cache_bytes_per_position(t, size) + 4 * t.vocab_size  # + its fp32 logits
    weights = weight_bytes(t, size)
    room = int(total_bytes * MEMORY_SHARE) - weights - OVERHEAD_BYTES
    batch = most = MAX_AUTO_BATCH_TRANSFORMERS if t.backend == "transformers" else MAX_AUTO_BATCH
    while batch > 1 and batch * per_row > room:
        batch //= 2
    gib = 1 << 30
    why = (
        f"auto: GPU memory {total_bytes / gib:.1f} GiB, target weights {weights / gib:.1f} GiB, "
        f"KV cache {per_row / gib:.2f} GiB a row at {capacity} positions (prompts up to {PROMPT_ALLOWANCE} "
        f"tokens + {max_new_tokens} new); at most {most}; --batch-size N sets it"
    )
    return batch, why
