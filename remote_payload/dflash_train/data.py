"""Training data: token sequences with loss masks, and per-epoch anchor (block) sampling.

A batch is a pure function of (dataset, seed, step): resuming at step t rebuilds the exact batches
an uninterrupted run would have seen, with no sampler state to checkpoint.
"""

from __future__ import annotations

import array
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import Config, DataConfig
from .decode import generate
from .regen_rows import KINDS, RegenError, RowError, encode_prompt, row_kind, token_ids
from .regen_rows import load_tokenizer as load_prompt_tokenizer
from .target import Qwen3Target, build_tiny_target

Sequence = tuple[torch.Tensor, torch.Tensor]  # (input_ids [T] long, loss_mask [T] bool)


class DataError(ValueError):
    """Bad training data (a malformed row, a missing tokenizer): the message is one line for the user."""


@dataclass
class Batch:
    """One training batch; N sequences padded to S, A anchors each."""

    input_ids: torch.Tensor  # [N, S] long (right-padded)
    loss_mask: torch.Tensor  # [N, S] bool: tokens the drafter is trained to predict
    anchors: torch.Tensor  # [N, A] long: block start positions (0 where invalid)
    anchor_valid: torch.Tensor  # [N, A] bool: False for padding anchors of short sequences
    lengths: torch.Tensor  # [N] long: unpadded lengths

    def to(self, device: torch.device | str) -> "Batch":
        """The batch on `device` (non-blocking copies)."""
        return Batch(
            *(
                t.to(device, non_blocking=True)
                for t in (self.input_ids, self.loss_mask, self.anchors, self.anchor_valid, self.lengths)
            )
        )

    def pinned(self) -> "Batch":
        """The batch in page-locked host memory: copies from pageable memory wait for the GPU's
        queued work, pinned ones do not, so the host can enqueue the next step early."""
        return Batch(
            *(t.pin_memory() for t in (self.input_ids, self.loss_mask, self.anchors, self.anchor_valid, self.lengths))
        )

    @property
    def num_tokens(self) -> int:
        """Unpadded sequence tokens in the batch (what the target reads)."""
        return int(self.lengths.sum())


def seeded_generator(*parts: int) -> torch.Generator:
    """A CPU generator seeded from integers (seed, epoch, index, ...), independent of global RNG."""
    value = 0
    for part in parts:
        value = (value * 1_000_003 + int(part) + 1) % (2**63 - 1)
    return torch.Generator().manual_seed(value)


def sample_anchors(
    loss_mask: torch.Tensor, num: int, block_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `num` distinct sorted anchors a that leave room for a whole block and whose next
    token is supervised (loss_mask[a+1], as SpecForge samples them): the block's first prediction
    always counts, so no block trains with zero weight (an anchor on the last token of an
    assistant turn used to predict only the next user turn's unsupervised tokens). Returns
    (anchors [num], valid [num]), padded with invalid anchors at 0."""
    room = max(0, loss_mask.shape[0] - block_size + 1)
    candidates = loss_mask[1 : room + 1].nonzero().flatten()
    chosen = candidates[torch.randperm(candidates.numel(), generator=generator)[:num]].sort().values
    anchors = torch.zeros(num, dtype=torch.long)
    valid = torch.zeros(num, dtype=torch.bool)
    anchors[: chosen.numel()] = chosen
    valid[: chosen.numel()] = True
    return anchors, valid


def collate(
    seqs: list[Sequence],
    max_length: int,
    anchors_per_seq: int,
    block_size: int,
    generators: list[torch.Generator],
    pad_id: int = 0,
) -> Batch:
    """Pad sequences to `max_length` (static shapes for compile) and sample their anchors."""
    n = len(seqs)
    ids = torch.full((n, max_length), pad_id, dtype=torch.long)
    mask = torch.zeros((n, max_length), dtype=torch.bool)
    anchors = torch.zeros((n, anchors_per_seq), dtype=torch.long)
    valid = torch.zeros((n, anchors_per_seq), dtype=torch.bool)
    lengths = torch.zeros(n, dtype=torch.long)
    for i, ((seq_ids, seq_mask), gen) in enumerate(zip(seqs, generators)):
        t = min(seq_ids.shape[0], max_length)
        ids[i, :t], mask[i, :t], lengths[i] = seq_ids[:t], seq_mask[:t], t
        anchors[i], valid[i] = sample_anchors(mask[i, :t], anchors_per_seq, block_size, gen)
    return Batch(ids, mask, anchors, valid, lengths)


class BlockSampler:
    """Deterministic batches: shuffled per epoch, anchors resampled per epoch, all from `seed`."""

    def __init__(self, seqs: list[Sequence], cfg: DataConfig, block_size: int, seed: int, shuffle: bool = True):
        if len(seqs) < cfg.batch_size:
            raise DataError(f"{len(seqs)} sequences are fewer than one batch ({cfg.batch_size})")
        self.seqs, self.cfg, self.block_size, self.seed, self.shuffle = seqs, cfg, block_size, seed, shuffle

    @property
    def steps_per_epoch(self) -> int:
        """Full batches per epoch (the ragged tail is dropped)."""
        return len(self.seqs) // self.cfg.batch_size

    def batch(self, step: int) -> Batch:
        """The batch for global step `step` (0-based)."""
        epoch, j = divmod(step, self.steps_per_epoch)
        order = (
            torch.randperm(len(self.seqs), generator=seeded_generator(self.seed, epoch))
            if self.shuffle
            else torch.arange(len(self.seqs))
        )
        idx = order[j * self.cfg.batch_size : (j + 1) * self.cfg.batch_size].tolist()
        gens = [seeded_generator(self.seed, epoch, i) for i in idx]
        return collate(
            [self.seqs[i] for i in idx], self.cfg.max_length, self.cfg.anchors_per_seq, self.block_size, gens
        )


# ----------------------------------------------------------------------------------------------
# Sources.


def load_jsonl(path: str | Path, tokenizer_path: str | None = None) -> list[Sequence]:
    """Rows of {"input_ids", "loss_mask"?} or chat {"messages", "reply_ids"?} (tokenised with the
    target's chat template via `transformers`, imported only if such rows appear)."""
    seqs: list[Sequence | None] = []
    tokens = TokenRows()
    tokenizer = None
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{line_no}: not JSON ({exc.msg})") from None
            if "input_ids" in row:
                try:
                    tokens.add(len(seqs), row["input_ids"], row.get("loss_mask"))
                except ValueError as exc:
                    raise DataError(f"{path}:{line_no}: {exc}") from None
                seqs.append(None)
            elif "messages" in row:
                tokenizer = tokenizer or load_tokenizer(tokenizer_path, path)
                try:
                    seqs.append(
                        tokenize_target_reply(row, tokenizer)
                        if "reply_ids" in row
                        else tokenize_chat(row["messages"], tokenizer)
                    )
                except ValueError as exc:
                    raise DataError(f"{path}:{line_no}: {exc}") from None
            else:
                raise DataError(f"{path}:{line_no}: row has neither input_ids nor messages")
    for i, seq in tokens.sequences():
        seqs[i] = seq
    return seqs


class TokenRows:
    """Token rows gathered into two flat arrays as they are read, made tensors once at the end and
    split into views: a tensor per row was a third of the time of reading 65,536 regenerated rows."""

    def __init__(self):
        self.ids, self.mask = array.array("q"), array.array("b")
        self.rows: list[tuple[int, int]] = []  # (index in the file's sequences, length)

    def add(self, index: int, ids, mask) -> None:
        """One row's input_ids and loss_mask (None: all supervised); ValueError if not flat integer lists."""
        if not isinstance(ids, list) or not isinstance(mask, (list, type(None))):
            raise ValueError("input_ids and loss_mask must be flat lists of integers")
        if mask is not None and len(mask) != len(ids):
            raise ValueError("loss_mask and input_ids differ in length")
        size = len(self.ids)
        try:
            self.ids.extend(ids)
            self.mask.extend([1] * len(ids) if mask is None else mask)
        except (TypeError, OverflowError):
            del self.ids[size:], self.mask[size:]
            raise ValueError("input_ids and loss_mask must be flat lists of integers") from None
        self.rows.append((index, len(ids)))

    def sequences(self) -> list[tuple[int, Sequence]]:
        """(index, (input_ids, loss_mask)) per row, in the order added."""
        if not self.rows:
            return []
        ids = torch.frombuffer(self.ids, dtype=torch.long) if self.ids else torch.zeros(0, dtype=torch.long)
        mask = (torch.frombuffer(self.mask, dtype=torch.int8) if self.mask else torch.zeros(0, dtype=torch.int8)).bool()
        lengths = [n for _, n in self.rows]
        return [(i, seq) for (i, _), seq in zip(self.rows, zip(ids.split(lengths), mask.split(lengths)))]


def load_tokenizer(tokenizer_path: str | None, data_path: str | Path):
    """The HF tokenizer for chat rows; a clear error if `transformers` or the path is missing."""
    if tokenizer_path is None:
        raise DataError(f"{data_path} has chat rows: set data.tokenizer_path or target.path")
    try:
        from transformers import AutoTokenizer  # lazy: only chat data needs it
    except ImportError:
        raise DataError(
            f"{data_path} has chat rows, which need the `transformers` package; "
            "install it or pre-tokenise to input_ids/loss_mask"
        ) from None
    if not Path(tokenizer_path, "tokenizer_config.json").is_file():
        raise DataError(
            f"{data_path} has chat rows: {tokenizer_path} is not a tokenizer directory "
            "(no tokenizer_config.json); data.tokenizer_path must be a local directory"
        )
    # Local files only: a training container must never fetch from a model hub mid-run.
    return AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)


def tokenize_chat(messages: list[dict], tokenizer) -> Sequence:
    """Render the whole conversation once with the chat template; loss_mask=1 on the tokens of
    each assistant reply: its content as rendered, and the end-of-turn token right after it.

    The replies are found by character offsets in that one rendering (a fast tokenizer's offset
    mapping), so a template that renders earlier turns differently once more follow (Qwen3 gives
    only the last assistant turn an empty think block) still gives exact masks. A template that
    rewrites a message's content is a DataError, not a shifted mask.
    """
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans, cursor = [], 0
    for i, message in enumerate(messages):
        content = message.get("content") or ""
        if not isinstance(content, str):
            raise DataError(f"message {i} ({message.get('role')}): content must be a string")
        if not content:
            continue
        at = text.find(content, cursor)
        if at < 0:
            raise DataError(
                f"message {i} ({message.get('role')}) does not appear as written in the rendered chat "
                "(the template rewrites it), so its tokens are unknown; pre-tokenise this row "
                "to input_ids/loss_mask"
            )
        end = at + len(content)
        if message.get("role") == "assistant":
            eos = tokenizer.eos_token
            if eos and text.startswith(eos, end):
                end += len(eos)  # the drafter learns where a reply ends
            spans.append((at, end))
        cursor = end
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(
            "chat rows need a fast tokenizer (its offsets place each reply); pre-tokenise to input_ids/loss_mask"
        )
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [hi > lo and any(a <= lo and hi <= b for a, b in spans) for lo, hi in enc["offset_mapping"]]
    return torch.tensor(enc["input_ids"], dtype=torch.long), torch.tensor(mask, dtype=torch.bool)


def tokenize_target_reply(row: dict, tokenizer) -> Sequence:
    """A chat row of `data regen` with the target's `reply_ids` (docs/data.md): the prompt as
    regen rendered it for the target (the conversation up to its last user turn, the template's
    generation prompt, the row's `enable_thinking`), unsupervised, then exactly the tokens the
    target emitted, supervised. Re-encoding the reply's text could give other tokens (a
    byte-level BPE merges what the target emitted apart), which the target never produced."""
    messages = row["messages"]
    if not (
        isinstance(messages, list)
        and len(messages) >= 2
        and all(isinstance(m, dict) for m in messages)
        and messages[-2].get("role") == "user"
        and messages[-1].get("role") == "assistant"
    ):
        raise DataError("a row with reply_ids must end with a user turn and the assistant reply they encode")
    kwargs = row.get("chat_template_kwargs") or {}
    if (
        not isinstance(kwargs, dict)
        or set(kwargs) - {"enable_thinking"}
        or not isinstance(kwargs.get("enable_thinking", False), bool)
    ):
        raise DataError("chat_template_kwargs may only hold enable_thinking (true or false)")
    reply = row["reply_ids"]
    if not isinstance(reply, list) or not reply or not all(type(t) is int and t >= 0 for t in reply):
        raise DataError("reply_ids must be a non-empty list of token ids")
    if tokenizer.decode(reply, skip_special_tokens=True) != messages[-1].get("content"):
        raise DataError(
            "reply_ids do not decode to the assistant reply (an edited reply, or another tokenizer than the target's)"
        )
    prompt, _ = encode_prompt(tokenizer, "messages", {"messages": messages[:-1]}, kwargs.get("enable_thinking"))
    return (
        torch.tensor(prompt + reply, dtype=torch.long),
        torch.tensor([False] * len(prompt) + [True] * len(reply), dtype=torch.bool),
    )


def demo_sequences(
    target: Qwen3Target, cfg: DataConfig, mask_token_id: int, seed: int
) -> tuple[list[Sequence], list[Sequence]]:
    """Greedy continuations of random prompts by the target itself: (train, held-out).

    Prompts are masked out of the loss; the continuation is deterministic given its prefix, so
    the drafter has something learnable.
    """
    prompts = demo_prompts(target.cfg.vocab_size, cfg, mask_token_id, seed)
    new = generate(target, prompts.tolist(), cfg.max_length - cfg.prompt_length, banned_ids=(mask_token_id,))
    ids = torch.cat([prompts, torch.tensor(new, dtype=torch.long)], dim=1)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[:, : cfg.prompt_length] = False
    seqs = list(zip(ids.unbind(0), mask.unbind(0)))
    return seqs[: cfg.num_train], seqs[cfg.num_train :]


def demo_prompts(vocab_size: int, cfg: DataConfig, mask_token_id: int, seed: int) -> torch.Tensor:
    """The random prompts the demo sequences start with, [num_train + num_eval, prompt_length]:
    drawn before (and without) the target's continuations."""
    n = cfg.num_train + cfg.num_eval
    prompts = torch.randint(0, vocab_size - 1, (n, cfg.prompt_length), generator=seeded_generator(seed, 7))
    prompts[prompts >= mask_token_id] += 1  # never the MASK id (random targets reserve the last)
    return prompts


def random_sequences(vocab_size: int, num: int, length: int, mask_token_id: int, seed: int) -> list[Sequence]:
    """Uniform random tokens (for speed benchmarks: the step's cost does not depend on them)."""
    ids = torch.randint(0, vocab_size - 1, (num, length), generator=seeded_generator(seed, 11))
    ids[ids >= mask_token_id] += 1
    return [(row, torch.ones(length, dtype=torch.bool)) for row in ids.unbind(0)]


def read_prompt_rows(source: str | Path) -> list[dict]:
    """Prompt rows from a JSONL file (`-`: stdin): `{"input_ids": [...]}`, `{"messages": [...]}`
    or `{"prompt": "..."}` per line, as `data regen` reads them (encoded by `encode_prompt_rows`),
    each with its line number."""
    return parse_prompt_rows(sys.stdin.buffer.read() if str(source) == "-" else Path(source).read_bytes())


def parse_prompt_rows(raw: bytes) -> list[dict]:
    """The prompt rows of a prompts file's bytes (`read_prompt_rows`)."""
    rows = []
    # Lines end at b"\n", as data regen and the trainer read them: str.splitlines() also splits
    # at U+2028 and other separators a JSON string may hold raw.
    for number, line in enumerate(raw.split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError:
            raise DataError(f"prompts line {number}: not UTF-8") from None
        except ValueError:
            row = None
        if not isinstance(row, dict) or not any(kind in row for kind in KINDS):
            raise DataError(f"prompts line {number}: expected a JSON object with input_ids, messages or prompt")
        rows.append({**row, "line": number})
    if not rows:
        raise DataError("the prompts file has no prompts")
    return rows


def encode_prompt_rows(rows: list[dict], tokenizer_dir: str | None, vocab_size: int) -> list[list[int]]:
    """Token ids of each prompt row: its input_ids, or its text / chat (with the template's
    generation prompt) through the run's tokenizer."""
    tok, prompts = None, []
    for row in rows:
        kind = row_kind(row)
        try:
            if kind == "input_ids":
                prompts.append(token_ids(row["input_ids"], vocab_size))
                continue
            if tok is None:
                if tokenizer_dir is None:
                    raise DataError(
                        f"prompts line {row['line']} is a {kind} row, but the run has no tokenizer "
                        "(data.tokenizer_path or target.path): give input_ids"
                    )
                tok = load_prompt_tokenizer(tokenizer_dir)
            prompts.append(encode_prompt(tok, kind, row, thinking=None)[0])
        except RowError as exc:
            raise DataError(f"prompts line {row['line']}: {exc}") from None
        except RegenError as exc:
            raise DataError(str(exc)) from None
    return prompts


def check_vocab(seqs: list[Sequence], vocab_size: int, path: str | Path) -> list[Sequence]:
    """`seqs`, or a DataError if a token id is negative or outside the target's vocabulary (on
    CUDA that would be a device-side assert in the embedding, far from its cause)."""
    low = min((int(ids.min()) for ids, _ in seqs if ids.numel()), default=0)
    if low < 0:
        raise DataError(f"{path} has token id {low}, which no token has (ids start at 0)")
    top = max((int(ids.max()) for ids, _ in seqs if ids.numel()), default=-1)
    if top >= vocab_size:
        raise DataError(
            f"{path} has token id {top}, outside the target's vocabulary ({vocab_size}): "
            "is data.tokenizer_path the target's tokenizer?"
        )
    return seqs


def demo_refused(cfg: Config) -> str | None:
    """Why the demo source cannot be built for this target (None: it can)."""
    if cfg.target.path is not None:
        return "data.source demo needs the random target (unset target.path)"
    if cfg.target.backend == "transformers":
        return "data.source demo needs the native random target: use data.source random or jsonl"
    return None


def build_datasets(cfg: Config, mask_token_id: int) -> tuple[list[Sequence], list[Sequence]]:
    """(train, held-out) sequences for the configured source (the same on every machine)."""
    d, seed = cfg.data, cfg.run.seed
    if d.source == "demo":
        why = demo_refused(cfg)
        if why is not None:
            raise DataError(why)
        # Generated on CPU in fp32 so the data do not depend on where training runs.
        return demo_sequences(build_tiny_target(cfg.target, cfg.target.seed), d, mask_token_id, seed)
    if d.source == "random":
        seqs = random_sequences(cfg.target.vocab_size, d.num_train + d.num_eval, d.max_length, mask_token_id, seed)
        return seqs[: d.num_train], seqs[d.num_train :]
    tokenizer_path = d.tokenizer_path or cfg.target.path
    vocab = cfg.target.vocab_size
    train = check_vocab(load_jsonl(d.train_path, tokenizer_path), vocab, d.train_path)
    if d.eval_path:
        return train, check_vocab(load_jsonl(d.eval_path, tokenizer_path), vocab, d.eval_path)
    # Hold out a deterministic slice of the shuffled rows.
    order = torch.randperm(len(train), generator=seeded_generator(seed, 13)).tolist()
    num_eval = max(1, int(len(train) * d.eval_fraction))
    return [train[i] for i in order[num_eval:]], [train[i] for i in order[:num_eval]]
