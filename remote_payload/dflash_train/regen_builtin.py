"""The `builtin` engine of `dflash_train.regen`: the trainer's target (native Qwen3, or any causal
LM through transformers: target_hf.py), one replica per worker thread (one thread per GPU, one on
CPU), each batch generated at once by decode.generate (left-padded, KV-cached): the same decode
path as `dflashctl eval`'s target-only decode.
A batch with failed rows (or the short last one) is filled up to --batch-size with one-token
filler prompts whose output is dropped; they run to --max-new-tokens, so such a batch never
ends early.

Each worker keeps one Decoder (its KV cache, and on CUDA its compiled layer parts and captured
step graphs) and reuses it while batches have its shape: the batch's rows and a capacity of its
longest prompt + --max-new-tokens rounded up to regen_batch.CAPACITY_STEP. The shape depends only on the
batch, so a resumed run decodes each batch exactly as an uninterrupted one. On CUDA a new
decoder first takes one step in each of its attention windows (Decoder.warm_up), under the
trainer's build/compile lock (workers.SerialLock): compiling and capturing CUDA graphs in two
threads at once is what docs/threaded-compile.md warns about. The threads themselves are
regen.py's: batches are independent jobs from a queue, where the trainer's workers step in
lockstep around an all-reduce."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from .config import Config
from .data import seeded_generator
from .regen_batch import auto_batch, cache_capacity
from .regen_rows import (
    Done,
    Options,
    Row,
    RowError,
    SharedTokenizer,
    chat_row,
    encode_prompt,
    row_kind,
    token_ids,
    token_row,
)
from .replica import DTYPES
from .target import build_random_target, load_hf_target
from .target_config import resolve_mask_token_id
from .target_hf import build_hf_target
from .workers import SerialLock, Stopped, ThreadedOptions, bind_device, use_cpu_threads


def batch_generator(seed: int, batch: int, device: str) -> torch.Generator:
    """The sampling generator of one batch: the same batch gets the same draws, also on resume."""
    state = seeded_generator(seed, batch).initial_seed()
    return torch.Generator(device=device).manual_seed(state)


def device_memory(devices: list[str]) -> int | None:
    """The smallest total memory of the CUDA devices, in bytes (None: CPU)."""
    sizes = [torch.cuda.get_device_properties(torch.device(d)).total_memory for d in devices if d != "cpu"]
    return min(sizes) if sizes else None


class BuiltinEngine:
    """Batched generation with the project's target; see the module docstring."""

    def __init__(self, cfg: Config, devices: list[str], tokenizer_dir: str | None, options: Options):
        self.cfg, self.devices = cfg, devices
        self.batch_reason = "--batch-size"
        if options.batch_size is None:
            memory = device_memory(devices)
            batch, self.batch_reason = auto_batch(cfg.target, cfg.run.dtype, options.max_new_tokens, memory)
            options = replace(options, batch_size=batch)
        self.options = options
        self.workers = len(devices)
        self.targets: list = [None] * len(devices)
        self.decoders: list = [None] * len(devices)  # per worker: ((rows, capacity), Decoder)
        # A worker waiting longer than the trainer's compile bound for another's warm-up fails.
        self.serial = SerialLock(options.stop, ThreadedOptions.compile_timeout_s)
        self.tokenizer = SharedTokenizer(
            tokenizer_dir, "chat and prompt rows need a tokenizer: --tokenizer DIR or target.path"
        )
        self.eos_ids = self._generation_eos()
        try:
            self.banned = (resolve_mask_token_id(cfg.target, None, tokenizer_dir),)  # MASK never appears in data
        except ValueError:
            self.banned = ()

    def _generation_eos(self) -> tuple[int, ...]:
        """End-of-sequence ids from the target's generation_config.json (Qwen3 has two)."""
        path = self.cfg.target.path
        try:
            raw = json.loads((Path(path) / "generation_config.json").read_text()).get("eos_token_id") if path else None
        except (OSError, ValueError):
            raw = None
        return tuple(raw if isinstance(raw, list) else [] if raw is None else [raw])

    def waiting(self) -> str | None:
        """No note: a batch's generation on the target's GPUs may take minutes, and says so when done."""
        return None

    def peak_memory_gb(self) -> float | None:
        """The most memory any worker's GPU has held in tensors since the start, in GiB (None: CPU)."""
        cuda = [torch.device(d) for d in self.devices if d != "cpu"]
        return max(torch.cuda.max_memory_allocated(d) for d in cuda) / 2**30 if cuda else None

    def setup(self, worker: int) -> None:
        """Build this worker's replica of the target on its device."""
        device, t = self.devices[worker], self.cfg.target
        bind_device(torch.device(device))
        if device == "cpu":
            use_cpu_threads(self.cfg.run.cpu_threads)
        dtype = DTYPES[self.cfg.run.dtype]
        if t.backend == "transformers":
            target = build_hf_target(t, [], device, dtype, whole=True)
        elif t.path is not None:
            target = load_hf_target(t.path, [], device, dtype, whole=True)
        else:
            target = build_random_target(t, t.seed, None, device, dtype)
        self.targets[worker] = target.eval()
        if self.tokenizer.path is not None:  # its end-of-turn token ends every row's generation, from the first batch
            with self.tokenizer as tok:
                if tok.eos_token_id is not None and tok.eos_token_id not in self.eos_ids:
                    self.eos_ids = self.eos_ids + (tok.eos_token_id,)

    def prompt_ids(self, row: Row) -> tuple[list[int], list[dict] | None]:
        """(the token ids to continue, the conversation for a chat row); RowError if it cannot be."""
        if row.error is not None:
            raise RowError(row.error)
        kind = row_kind(row.data)
        if kind == "input_ids":
            return token_ids(row.data["input_ids"], self.cfg.target.vocab_size), None
        with self.tokenizer as tok:
            return encode_prompt(tok, kind, row.data, self.options.thinking)

    def decoder(self, worker: int, rows: int, need: int):
        """This worker's decoder for `rows` prompts needing `need` positions (see the module docstring)."""
        from .decode import make_decoder

        limit = self.cfg.target.max_position_embeddings
        key = (rows, cache_capacity(need, limit))
        held = self.decoders[worker]
        if held is not None and held[0] == key:
            return held[1]
        self.decoders[worker] = held = None  # the old cache goes before the new one is allocated
        target = self.targets[worker]
        decoder = make_decoder(target, rows, key[1])
        if decoder.graphs:
            with self.serial.held(f"regen worker {worker} ({self.devices[worker]}) warm-up"):
                decoder.warm_up()  # compiles, and captures every step graph up to the capacity
        self.decoders[worker] = (key, decoder)
        return decoder

    def run(self, worker: int, batch: int, rows: list[Row]) -> list[Done] | None:
        """Generate the batch's valid rows together; the others are errors. None: a stop came
        while this worker waited for another's warm-up (the batch is redone on resume)."""
        try:
            return self._generate(worker, batch, rows)
        except Stopped:
            return None

    def _generate(self, worker: int, batch: int, rows: list[Row]) -> list[Done]:
        from .decode import generate

        o, limit = self.options, self.cfg.target.max_position_embeddings
        done: dict[int, Done] = {}
        ready: list[tuple[Row, list[int], list[dict] | None]] = []
        for row in rows:
            try:
                ids, convo = self.prompt_ids(row)
                if len(ids) + o.max_new_tokens > limit:
                    raise RowError(
                        f"prompt of {len(ids)} tokens + {o.max_new_tokens} new ones exceeds the "
                        f"target's context of {limit}"
                    )
                ready.append((row, ids, convo))
            except RowError as exc:
                done[row.index] = Done(row.index, error=str(exc))
        if ready:
            device = self.devices[worker]
            gen = batch_generator(o.seed, batch, device) if o.temperature > 0 else None
            # Filler rows keep every batch at --batch-size (rows do not see each other): one
            # decoder shape for the run, whatever rows failed.
            prompts = [ids for _, ids, _ in ready] + [[0]] * (o.batch_size - len(ready))
            decoder = self.decoder(worker, len(prompts), max(map(len, prompts)) + o.max_new_tokens)
            news = generate(
                self.targets[worker],
                prompts,
                o.max_new_tokens,
                temperature=o.temperature,
                top_p=o.top_p,
                eos_ids=self.eos_ids,
                generator=gen,
                banned_ids=self.banned,
                decoder=decoder,
            )
            for (row, ids, convo), new in zip(ready, news):
                finish = "stop" if new and new[-1] in self.eos_ids else "length"
                if convo is None:
                    out = token_row(row.index, ids, new, finish)
                else:
                    with self.tokenizer as tok:
                        reply = tok.decode(new, skip_special_tokens=True)
                    out = chat_row(row.index, convo, reply, finish, new, o.thinking)
                done[row.index] = Done(row.index, out, new_tokens=len(new))
        return [done[row.index] for row in rows]
