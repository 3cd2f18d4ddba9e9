"""Build a small Qwen3 target with real structure, from Python source found on the machine (issue 26).

    python3 bench/build_target.py --out /tmp/qwen3-py                 # GPU: ~95M params, <= 4 minutes
    python3 bench/build_target.py --out /tmp/qwen3-py --size small    # CPU: a few minutes
    python3 bench/build_target.py --out /tmp/qwen3-py --size tiny --steps 300   # CPU, deterministic

The corpus is Python source of the running interpreter: `--corpus python` (the GPU default) reads
its standard library and its site-packages (hundreds of MB on a machine with torch, so a 95M
model sees each file about once and cannot memorise it), `--corpus stdlib` the standard library
alone (the CPU sizes). A few standard-library packages are held out for evaluation prompts
(`--held-out`, their tests included); files of the same name anywhere else, and known copies of
them (`simplejson` is the stdlib `json`'s origin), are left out of training. The directory written is what a
user's own checkpoint looks like to the
trainer and to transformers: `config.json` + `model.safetensors` (a `transformers`
Qwen3ForCausalLM, untied head, no attention bias), `generation_config.json`, and a byte-level BPE
`tokenizer.json` (trained here with `tokenizers`, with `<|MASK|>` and ChatML specials) with
`tokenizer_config.json` and a ChatML chat template, so `{"prompt"}` and `{"messages"}` rows both
work. Beside them: `train-prompts.jsonl` (`{"prompt"}` rows from the training text, for `data
push` + `data regen`), `heldout-prompts.jsonl` (from the held-out packages, for `dflashctl eval`)
and `build.json` (the options, the sizes, the losses, the times).

The module is also the builder of the CI quality check (tests/payload/test_quality.py): one
implementation; `build(options)` is the entry point for both.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import json
import math
import os
import random
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

MASK, EOT, IM_START, IM_END = "<|MASK|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIALS = (EOT, IM_START, IM_END, MASK)
# ChatML, as Qwen3 renders it without thinking: what `{"messages"}` rows go through.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Packages whose code (and tests) the target never sees: present in every CPython 3.10-3.13.
HELD_OUT = ("email", "json", "http", "xml")
# Third-party copies of held-out packages: never trained on either (they would leak the prompts).
COPIES_OF_HELD_OUT = ("simplejson",)
SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}
CORPORA = ("stdlib", "python")


@dataclass(frozen=True)
class ModelSize:
    """The target's shape and vocabulary."""

    vocab_size: int
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


SIZES = {
    "gpu": ModelSize(8192, 12, 768, 2304, 12, 4, 64),  # ~95M parameters, untied head
    "small": ModelSize(4096, 4, 256, 768, 4, 2, 64),  # CPU dry runs of the bench (~5M)
    "tiny": ModelSize(1024, 2, 64, 192, 4, 2, 16),  # the CI check (~0.2M)
}


@dataclass
class BuildOptions:
    """What `build` makes; the defaults are the GPU bench's target."""

    out: Path
    size: str = "gpu"
    minutes: float = 4.0  # the whole build's budget: model training gets what is left of it
    steps: int | None = None  # train exactly this many steps instead (deterministic: the CI check)
    seq_len: int = 512
    batch_size: int = 32
    lr: float = 8e-4
    warmup: float = 0.1  # fraction of training spent warming up to lr (3% to 1.5e-3 diverged at 95M on a GPU)
    seed: int = 0
    device: str = "auto"  # auto: cuda when there is one, else cpu
    source: Path | None = None  # None: the running interpreter's Python source, as `corpus` says
    corpus: str = "python"  # python: stdlib + site-packages; stdlib: the standard library alone
    held_out: tuple[str, ...] = HELD_OUT
    max_corpus_mb: float | None = 160.0  # train on at most this much text (~1 epoch in 4 minutes on an H200)
    tokenizer_mb: float = 8.0  # of which the BPE trainer reads at most this much
    train_prompts: int = 16384
    eval_prompts: int = 64
    prompt_chars: int = 400  # a prompt: whole lines, about this many characters
    cpu_threads: int = 0  # torch intra-op threads; 0 keeps torch's default


# -- corpus ------------------------------------------------------------------------------------


def is_held_out(rel: Path, held_out: tuple[str, ...]) -> bool:
    """A file of a held-out package, or of its tests (`test_email/`, `test_json.py`, ...)."""
    for part in rel.parts:
        stem = part.removesuffix(".py")
        if stem in held_out or any(stem.startswith(f"test_{name}") for name in held_out):
            return True
    return False


def read_python(root: Path) -> list[tuple[Path, str]]:
    """(path relative to root, text) of the .py files under root in sorted path order, site-packages
    pruned; files that are not UTF-8 (the tokenizer tests' bad-coding samples) are skipped."""
    paths = []
    for top, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS]
        paths += [Path(top, f) for f in files if f.endswith(".py")]
    found = []
    for path in sorted(paths):
        try:
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip():
            found.append((path.relative_to(root), text))
    return found


def python_files(root: Path, held_out: tuple[str, ...], extra: tuple[Path, ...] = ()) -> tuple[list[str], list[str]]:
    """(training texts, held-out texts): root's files split by `is_held_out`, then the training
    files of the `extra` trees (site-packages), whose held-out namesakes and copies are dropped."""
    train, held = [], []
    for rel, text in read_python(root):
        (held if is_held_out(rel, held_out) else train).append(text)
    for tree in extra:
        train += [text for rel, text in read_python(tree) if not is_held_out(rel, held_out + COPIES_OF_HELD_OUT)]
    return train, held


def corpus_roots(opts: "BuildOptions") -> tuple[Path, tuple[Path, ...]]:
    """(the tree holding the held-out packages, further training trees) for the options."""
    if opts.source is not None:
        return Path(opts.source), ()
    paths = sysconfig.get_paths()
    if opts.corpus == "stdlib":
        return Path(paths["stdlib"]), ()
    return Path(paths["stdlib"]), tuple(sorted({Path(paths["purelib"]), Path(paths["platlib"])}))


def capped(texts: list[str], mb: float | None, seed: int) -> list[str]:
    """At most `mb` MB of the texts, whole files drawn in a seeded order (all when mb is None)."""
    if mb is None:
        return texts
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    chosen, total = [], 0
    for i in order:
        if total >= mb * 1e6:
            break
        chosen.append(i)
        total += len(texts[i])
    return [texts[i] for i in sorted(chosen)]


def prompt_rows(texts: list[str], count: int, chars: int, seed: int) -> list[dict]:
    """`count` distinct `{"prompt"}` rows: whole lines from a random place in the texts (drawn by
    size), about `chars` characters (at most 4x), ending at a line end."""
    rng, rows, seen = random.Random(seed), [], set()
    ends = list(_accumulate(len(t) for t in texts))
    for _ in range(count * 20):
        if len(rows) >= count or not ends:
            break
        at = rng.randrange(ends[-1])
        doc = bisect.bisect_right(ends, at)
        text = texts[doc]
        offset = at - (ends[doc - 1] if doc else 0)
        start = text.find("\n", offset) + 1 if offset else 0
        stop = text.find("\n", start + chars)
        piece = text[start : stop + 1] if stop >= 0 else ""
        # A generated file's one long line (data tables in site-packages) would make a prompt longer
        # than the target's context: such a row only fails in `data regen`.
        if start and chars // 2 <= len(piece.strip()) and len(piece) <= 4 * chars and piece not in seen:
            seen.add(piece)
            rows.append({"prompt": piece})
    return rows


def _accumulate(values):
    total = 0
    for v in values:
        total += v
        yield total


# -- tokenizer ---------------------------------------------------------------------------------


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE `tokenizers.Tokenizer` with the special tokens first (ids 0-3)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer, length=len(texts))
    return tok


def save_tokenizer(tok, out: Path) -> dict[str, int]:
    """tokenizer.json + tokenizer_config.json (ChatML template, `<|im_end|>` ends a turn) via
    transformers; the special tokens' ids."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=EOT, additional_special_tokens=[IM_START, MASK]
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    # transformers 5 keeps the template in chat_template.jinja; 4.x reads it from here.
    config_file = out / "tokenizer_config.json"
    config_file.write_text(
        json.dumps({**json.loads(config_file.read_text()), "chat_template": CHAT_TEMPLATE}, indent=2) + "\n"
    )
    return {name: tok.token_to_id(name) for name in SPECIALS}


# -- model -------------------------------------------------------------------------------------


def qwen3_config(size: ModelSize, max_positions: int, ids: dict[str, int]):
    """The transformers Qwen3Config of this size (untied head: as the 8B target)."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=size.vocab_size,
        hidden_size=size.hidden_size,
        intermediate_size=size.intermediate_size,
        num_hidden_layers=size.num_layers,
        num_attention_heads=size.num_heads,
        num_key_value_heads=size.num_kv_heads,
        head_dim=size.head_dim,
        max_position_embeddings=max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        attention_bias=False,
        eos_token_id=ids[IM_END],
        pad_token_id=ids[EOT],
        bos_token_id=None,
    )


def token_stream(tok, texts: list[str], eot: int):
    """Every text's ids, each followed by `<|endoftext|>`, as one long tensor (int32 pieces joined
    once: a Python list of tens of millions of ids would cost gigabytes)."""
    import numpy as np
    import torch

    pieces = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        pieces += [np.asarray(enc.ids, dtype=np.int32), np.asarray([eot], dtype=np.int32)]
    return torch.from_numpy(np.concatenate(pieces) if pieces else np.zeros(0, np.int32)).long()


def windows(stream, batch: int, seq_len: int, gen):
    """`batch` random windows of seq_len tokens (a seeded generator: the same on every run)."""
    import torch

    starts = torch.randint(0, len(stream) - seq_len, (batch,), generator=gen)
    return torch.stack([stream[s : s + seq_len] for s in starts.tolist()])


def lr_at(progress: float, peak: float, warmup: float) -> float:
    """Linear warm-up over the first `warmup` of training, then cosine to a tenth of the peak."""
    if progress < warmup:
        return peak * max(progress / warmup, 0.01)
    frac = min(1.0, (progress - warmup) / (1 - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def train_model(config, stream, opts: BuildOptions, device, deadline: float, log: Callable[[str], None]):
    """A Qwen3ForCausalLM trained on windows of the stream: `opts.steps` steps, else until the
    deadline (time.monotonic()); bf16 autocast on CUDA. (model in eval mode, steps, last loss)."""
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(opts.seed)
    model = Qwen3ForCausalLM(config).to(device)
    model.train()
    cuda = device.type == "cuda"
    optim = torch.optim.AdamW(
        model.parameters(), lr=opts.lr, betas=(0.9, 0.95), weight_decay=0.1, **({"fused": True} if cuda else {})
    )
    gen = torch.Generator().manual_seed(opts.seed)
    t0, step, loss_value = time.monotonic(), 0, float("nan")
    budget = max(deadline - t0, 1e-3)
    while True:
        progress = step / opts.steps if opts.steps else (time.monotonic() - t0) / budget
        if progress >= 1.0:
            break
        for group in optim.param_groups:
            group["lr"] = lr_at(progress, opts.lr, opts.warmup)
        x = windows(stream, opts.batch_size, opts.seq_len, gen).to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)
        step += 1
        if step % 100 == 0 or step == 1:
            loss_value = loss.detach().item()
            log(f"build: step {step} loss {loss_value:.3f} ({time.monotonic() - t0:.0f} s)")
            if not math.isfinite(loss_value):  # a diverged target is no target: never write it
                raise SystemExit(f"build: the loss diverged at step {step}; lower --lr (now {opts.lr:g})")
    loss_value = loss.detach().item() if step else loss_value
    return model.eval(), step, loss_value


def mean_loss(model, stream, opts: BuildOptions, device, batches: int = 4) -> float | None:
    """The model's mean next-token loss on seeded windows of a stream (None: too short)."""
    import torch

    if len(stream) <= opts.seq_len:
        return None
    gen, total = torch.Generator().manual_seed(opts.seed + 1), 0.0
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
        for _ in range(batches):
            x = windows(stream, min(opts.batch_size, 8), opts.seq_len, gen).to(device)
            total += float(model(input_ids=x, labels=x).loss)
    return total / batches


# -- the build ---------------------------------------------------------------------------------


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """One JSON object per line."""
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def build(opts: BuildOptions, log: Callable[[str], None] = print) -> dict:
    """Write the target directory (see the module docstring); the summary also in build.json."""
    import torch

    started = time.monotonic()
    deadline = started + opts.minutes * 60
    size = SIZES[opts.size]
    if opts.cpu_threads > 0:
        torch.set_num_threads(opts.cpu_threads)
    device = torch.device(
        "cuda"
        if opts.device == "auto" and torch.cuda.is_available()
        else "cpu"
        if opts.device == "auto"
        else opts.device
    )
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    root, extra = corpus_roots(opts)
    train_texts, held_texts = python_files(root, opts.held_out, extra)
    found_mb = sum(map(len, train_texts)) / 1e6
    train_texts = capped(train_texts, opts.max_corpus_mb, opts.seed)
    if not train_texts or not held_texts:
        raise SystemExit(
            f"build_target: no training or held-out .py files under {root} (held out: {', '.join(opts.held_out)})"
        )
    log(
        f"build: {len(train_texts)} training files ({sum(map(len, train_texts)) / 1e6:.1f} MB of {found_mb:.1f} "
        f"found), {len(held_texts)} held-out files, from {root}" + "".join(f" + {tree}" for tree in extra)
    )
    tok = train_tokenizer(capped(train_texts, opts.tokenizer_mb, opts.seed + 2), size.vocab_size)
    ids = save_tokenizer(tok, out)
    stream, held_stream = token_stream(tok, train_texts, ids[EOT]), token_stream(tok, held_texts, ids[EOT])
    tokenized = time.monotonic()
    log(
        f"build: tokenizer of {tok.get_vocab_size()} ids, {len(stream):,} training tokens "
        f"({len(held_stream):,} held out) after {tokenized - started:.1f} s"
    )
    config = qwen3_config(size, 4096, ids)
    # Saving and the prompt files take seconds: keep them inside the budget.
    model, steps, loss = train_model(config, stream, opts, device, deadline - 10, log)
    trained = time.monotonic()
    held_loss = mean_loss(model, held_stream, opts, device)
    model.to(torch.float32).save_pretrained(str(out))
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [ids[IM_END], ids[EOT]], "pad_token_id": ids[EOT]}, indent=1) + "\n"
    )
    train_rows = prompt_rows(train_texts, opts.train_prompts, opts.prompt_chars, opts.seed + 3)
    held_rows = prompt_rows(held_texts, opts.eval_prompts, opts.prompt_chars, opts.seed + 4)
    write_jsonl(out / "train-prompts.jsonl", train_rows)
    write_jsonl(out / "heldout-prompts.jsonl", held_rows)
    summary = {
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(opts).items()},
        "size": dataclasses.asdict(size),
        "parameters": sum(p.numel() for p in model.parameters()),
        "device": str(device),
        "source": [str(root), *map(str, extra)],
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "special_ids": ids,
        "training_tokens": len(stream),
        "held_out_tokens": len(held_stream),
        "steps": steps,
        "tokens_seen": steps * opts.batch_size * opts.seq_len,
        "train_loss": loss,
        "held_out_loss": held_loss,
        "train_prompts": len(train_rows),
        "heldout_prompts": len(held_rows),
        "tokenizer_s": round(tokenized - started, 1),
        "train_s": round(trained - tokenized, 1),
        "total_s": round(time.monotonic() - started, 1),
    }
    (out / "build.json").write_text(json.dumps(summary, indent=1) + "\n")
    log(
        f"build: {summary['parameters'] / 1e6:.1f}M parameters, {steps} steps in {summary['train_s']} s, "
        f"loss {loss:.3f}, held-out loss {held_loss if held_loss is None else round(held_loss, 3)}; "
        f"{len(train_rows)} + {len(held_rows)} prompt rows; {out} in {summary['total_s']} s"
    )
    return summary


def main(argv: list[str] | None = None) -> int:
    """The command line: options of BuildOptions."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="the target directory to write")
    ap.add_argument("--size", choices=sorted(SIZES), default="gpu")
    ap.add_argument("--minutes", type=float, default=4.0, help="the whole build's time budget")
    ap.add_argument("--steps", type=int, default=None, help="train exactly this many steps (deterministic)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=8e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--source", type=Path, default=None, help="one tree of .py files instead of --corpus")
    ap.add_argument(
        "--corpus",
        choices=CORPORA,
        default=None,
        help="python: stdlib + site-packages; stdlib: the standard library alone "
        "(default: python for --size gpu, stdlib for the CPU sizes)",
    )
    ap.add_argument("--held-out", default=",".join(HELD_OUT), help="packages left out for evaluation prompts")
    ap.add_argument(
        "--max-corpus-mb", type=float, default=None, help="default 160 for --corpus python, all of the stdlib"
    )
    ap.add_argument("--tokenizer-mb", type=float, default=8.0)
    ap.add_argument("--prompt-chars", type=int, default=400)
    ap.add_argument("--train-prompts", type=int, default=16384)
    ap.add_argument("--eval-prompts", type=int, default=64)
    ap.add_argument("--cpu-threads", type=int, default=0)
    a = ap.parse_args(argv)
    corpus = a.corpus or ("python" if a.size == "gpu" else "stdlib")
    corpus_mb = a.max_corpus_mb if a.max_corpus_mb is not None else 160.0 if corpus == "python" else None
    build(
        BuildOptions(
            out=a.out,
            size=a.size,
            minutes=a.minutes,
            steps=a.steps,
            seq_len=a.seq_len,
            batch_size=a.batch_size,
            lr=a.lr,
            seed=a.seed,
            device=a.device,
            source=a.source,
            corpus=corpus,
            held_out=tuple(filter(None, a.held_out.split(","))),
            max_corpus_mb=corpus_mb,
            tokenizer_mb=a.tokenizer_mb,
            prompt_chars=a.prompt_chars,
            train_prompts=a.train_prompts,
            eval_prompts=a.eval_prompts,
            cpu_threads=a.cpu_threads,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
