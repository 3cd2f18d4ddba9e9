"""`python -m dflash_train.regen --prompts IN.jsonl --out OUT.jsonl [options]`: the target's own
responses to a set of prompts, written as rows the trainer reads (the DFlash recipe: a drafter
learns to predict its target, so it trains on what the target itself says). docs/data.md.

Input rows, one per non-blank line; a row's index counts them from 0. The first key found wins:
  {"messages": [...]}   a chat: the next assistant turn for the conversation up to its last user
                        turn; out: {"index", "messages": that conversation + the reply,
                        "reply_ids" (builtin: the reply's tokens as the target emitted them),
                        "chat_template_kwargs"? (its --thinking), "finish_reason"}
  {"prompt": "..."}     plain text, continued as it is; out: {"index", "input_ids", "loss_mask",
                        "finish_reason"}, the prompt's tokens masked out
  {"input_ids": [...]}  token ids (a target without a tokenizer); out as for "prompt"

Exact and resumable: results are appended in input order to a hidden partial file beside OUT
(`.<name>.partial`), each batch flushed and fsynced, a failed row as a marker line. `--resume`
reads it back (a torn last line is dropped) and goes on at the first row it lacks, redoing that
row's whole batch with the batch's own seed: the result equals an uninterrupted run's. Once
every row is there, the partial is split into OUT and, if rows failed, `<stem>.errors.jsonl`
({"index", "reason"}), each through a temporary file and a rename, and removed.

Exit codes: 0 done, 1 an engine failure (an endpoint that stays down, a batch that does not fit
the GPU: resume after fixing it), 2 bad input (every row failed
included: no output is written then), 4 a missing module, 143 (130) stopped by SIGTERM
(SIGINT): the batches in flight are finished and written first. `--preflight` checks arguments, files and
devices without generating and prints one JSON line, as the trainer's pre-flight does.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import queue
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

from .lines import say
from .regen_options import ENGINES, check_options
from .regen_output import Output, Progress, partial_path
from .regen_rows import Done, Options, RegenError, Row, Survey, read_batches, survey_rows

EXIT_FAILED, EXIT_USAGE, EXIT_MISSING = 1, 2, 4
QUIET_S = 60.0  # no row finished for this long (a server that accepts and never answers): say so, as often
DEFAULT_BATCH = {"builtin": None, "openai": 1}  # builtin: the largest that fits (regen_batch)


class Engine(Protocol):
    """Turns batches of rows into results, from `workers` threads at once."""

    workers: int
    options: Options
    batch_reason: str  # why options.batch_size is what it is, for the log ("": nothing to say)

    def setup(self, worker: int) -> None:
        """Prepare worker `worker` (build its target replica); runs in that worker's thread."""

    def run(self, worker: int, batch: int, rows: list[Row]) -> list[Done] | None:
        """Results for the batch's rows in order (None: abandoned for a stop, redone on resume)."""

    def waiting(self) -> str | None:
        """What the workers wait on, for the note when no row has finished for a while (None: no note)."""

    def peak_memory_gb(self) -> float | None:
        """The most memory a worker's GPU has held since the start, in GiB (None: not known)."""


# --- the scheduler --------------------------------------------------------------------------------


def work_loop(engine: Engine, worker: int, work: queue.Queue, results: queue.Queue) -> None:
    """One worker thread: set up, then run batches from the shared queue until None."""
    try:
        engine.setup(worker)
    except BaseException as exc:  # noqa: BLE001 - reported to the main thread, which ends the run
        results.put((None, exc))
        return
    while True:
        item = work.get()
        if item is None:
            return
        number, rows = item
        try:
            results.put((number, engine.run(worker, number, rows)))
        except BaseException as exc:  # noqa: BLE001 - see above
            results.put((number, exc))
            return


def regenerate(
    engine: Engine, batches: Iterator[tuple[int, list[Row]]], output: Output, progress: Progress, stop: threading.Event
) -> BaseException | None:
    """Run every batch through the engine's workers and write the results in input order. A
    stop (or a failure) issues no new batch, waits for those in flight and writes what is in
    order; returns the failure, if any."""
    work: queue.Queue = queue.Queue()
    results: queue.Queue = queue.Queue()
    threads = [
        threading.Thread(target=work_loop, args=(engine, w, work, results), daemon=True, name=f"regen-{w}")
        for w in range(engine.workers)
    ]
    for t in threads:
        t.start()
    window = 2 * engine.workers  # batches issued and not yet written: bounds what waits in memory
    pending: dict[int, list[Done] | None] = {}  # finished out of order (None: abandoned or failed)
    expected = None  # the batch to write next
    in_flight, alive, exhausted, failure = 0, len(threads), False, None
    quiet = Quiet(engine, progress.log)
    while True:
        while not (stop.is_set() or failure is not None or exhausted) and in_flight + len(pending) < window:
            item = next(batches, None)
            if item is None:
                exhausted = True
                break
            expected = item[0] if expected is None else expected
            work.put(item)
            in_flight += 1
        if in_flight == 0 or alive == 0:
            break
        try:
            number, result = results.get(timeout=0.2)
        except queue.Empty:
            quiet.check()
            continue
        quiet.reset()
        if number is None:  # a worker could not set up
            failure, alive = failure or result, alive - 1
            continue
        in_flight -= 1
        if isinstance(result, BaseException):
            failure, alive, result = failure or result, alive - 1, None
        pending[number] = result
        while pending.get(expected) is not None:
            done = pending.pop(expected)
            output.write(done)
            progress.update(output.next_index, output.failed, sum(d.new_tokens for d in done))
            expected += 1
        if expected in pending:  # nothing after an unwritten batch can be written in order
            stop.set()
    for _ in threads:
        work.put(None)
    for t in threads:
        # Every batch has come back, so each worker is at its queue and ends now; one still
        # inside torch when the interpreter exits would abort it (std::terminate).
        t.join()
    progress.update(output.next_index, output.failed, 0, final=True)
    return failure


class Quiet:
    """The note when no row has finished for QUIET_S, repeated as often while none does: each
    request to a server that accepts and never answers waits minutes, in silence otherwise."""

    def __init__(self, engine: Engine, log: Callable[[str], None]):
        self.engine, self.log = engine, log
        self.reset()

    def reset(self) -> None:
        """A result came back."""
        self.since = time.monotonic()
        self.due = self.since + QUIET_S

    def check(self) -> None:
        """Log the note when it is due and the engine has something to say."""
        now = time.monotonic()
        if now < self.due:
            return
        self.due = now + QUIET_S
        what = self.engine.waiting()
        if what:
            self.log(f"regen: no row finished in the last {now - self.since:.0f} s; {what}")


# --- the program ----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring and docs/data.md)."""
    ap = argparse.ArgumentParser(prog="python -m dflash_train.regen", description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", required=True, help="input JSONL")
    ap.add_argument("--out", required=True, help="output JSONL (the errors file goes beside it)")
    ap.add_argument("--engine", choices=ENGINES, default="builtin")
    ap.add_argument("--gpus", default="auto", help="builtin: auto (every visible GPU, else cpu), cpu, or 0,1")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--thinking",
        choices=("on", "off"),
        help="enable_thinking of Qwen3 chat templates (default: the template's own)",
    )
    ap.add_argument(
        "--batch-size",
        type=int,
        help="rows per batch (builtin: the largest up to 256 that fits the GPU memory, 32 on CPU; openai: 1)",
    )
    ap.add_argument("--tokenizer", help="HF tokenizer directory (default: target.path; openai: none)")
    ap.add_argument("--preset", help="builtin: the target's preset (tiny, qwen3-8b)")
    ap.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="builtin: target.*, run.dtype or run.cpu_threads (repeatable)",
    )
    ap.add_argument("--endpoint", help="openai: the server's base URL, e.g. http://127.0.0.1:8000")
    ap.add_argument("--model", help="openai: the model name the server serves")
    ap.add_argument("--concurrency", type=int, default=8, help="openai: requests at once")
    ap.add_argument(
        "--retries", type=int, default=8, help="openai: attempts after a 429, 5xx, connection error or non-JSON answer"
    )
    ap.add_argument("--metrics", help="append progress records (JSONL) here")
    ap.add_argument("--resume", action="store_true", help="continue the partial output of an interrupted run")
    ap.add_argument("--preflight", action="store_true", help="check everything, print one JSON line, generate nothing")
    return ap.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """Options that make no sense, whatever the machine (RegenError)."""
    try:
        check_options(args)
    except ValueError as exc:
        raise RegenError(str(exc)) from None
    prompts = Path(args.prompts)
    if not prompts.is_file():
        raise RegenError(f"no such prompts file: {prompts}")
    if args.tokenizer and not Path(args.tokenizer, "tokenizer_config.json").is_file():
        raise RegenError(f"--tokenizer {args.tokenizer} is not a tokenizer directory (no tokenizer_config.json)")
    out = Path(args.out)
    if not out.parent.is_dir():
        raise RegenError(f"no such directory for --out: {out.parent}")
    if not args.resume:
        for path in (out, partial_path(out)):
            if path.exists():
                raise RegenError(
                    f"{path} exists already (an earlier regen): choose another output name"
                    + (", or resume that run" if path != out else "")
                )


def check_tokenizer(args: argparse.Namespace, target_path: str | None, survey: Survey) -> None:
    """When any row needs a tokenizer (chat or prompt rows with the builtin engine, prompt or
    token rows with openai): one is configured and `transformers` is there to load it."""
    needs = ("messages", "prompt") if args.engine == "builtin" else ("prompt", "input_ids")
    found = sorted((survey.first[k], k) for k in needs if k in survey.first)
    if not found:
        return
    line, kind = found[0]
    if not (args.tokenizer or target_path):
        how = (
            "need a tokenizer: --tokenizer DIR, or target.path"
            if args.engine == "builtin"
            else "come back as text: the openai engine needs --tokenizer DIR to turn them into input_ids"
        )
        raise RegenError(f"{args.prompts} has {kind} rows (the first on line {line}), which {how}")
    if importlib.util.find_spec("transformers") is None:
        raise ImportError("transformers is needed for the tokenizer", name="transformers")


def build_engine(args: argparse.Namespace, preflight: bool, survey: Survey) -> tuple[Engine | None, dict]:
    """The engine (None for a pre-flight) and the pre-flight's answer fields; `survey`: the prompts'."""
    opts = Options(
        args.max_new_tokens,
        args.temperature,
        args.top_p,
        args.seed,
        None if args.thinking is None else args.thinking == "on",
        args.batch_size or DEFAULT_BATCH[args.engine],
    )
    if args.engine == "openai":
        from .regen_openai import OpenAIEngine

        check_tokenizer(args, None, survey)
        # The pre-flight's one format (plan.preflight_answer); the server holds the model, the run nothing.
        answer = {
            "ok": True,
            "holds": [],
            "pin": [],
            "devices": [],
            "summary": [f"engine: openai, {args.endpoint} model {args.model}, {args.concurrency} requests at once"],
            "plan": {"devices": [], "holds": [], "pin": [], "reasons": ["engine openai: the server holds the model"]},
        }
        if preflight:
            return None, answer
        return OpenAIEngine(args.endpoint, args.model, args.concurrency, args.retries, opts, args.tokenizer), answer
    from .plan import preflight_answer
    from .regen_plan import resolve_target

    cfg, devices = resolve_target(args.preset, args.overrides, args.gpus)
    check_tokenizer(args, cfg.target.path, survey)
    summary = [
        f"engine: builtin, target {cfg.target.path or 'random ' + str(cfg.target.num_layers) + ' layers'}"
        f", {cfg.run.dtype}, devices {', '.join(devices.workers)} ({devices.reason})"
    ]
    answer = preflight_answer(
        devices,
        summary,
        {
            "devices": list(devices.workers),
            "holds": list(devices.holds),
            "pin": list(devices.pin),
            "dtype": cfg.run.dtype,
            "reasons": [devices.reason],
        },
    )
    if preflight:
        return None, answer
    from .bytecode import keep_bytecode_saying

    keep_bytecode_saying(cfg.run.bytecode_cache_dir, say)  # before torch
    from .regen_builtin import BuiltinEngine  # torch: after the pre-flight's answer

    return BuiltinEngine(cfg, list(devices.workers), args.tokenizer or cfg.target.path, opts), answer


def main(argv: list[str] | None = None) -> int:
    """Parse, check, regenerate; the exit code (see the module docstring)."""
    args = parse_args(argv)
    try:
        check_args(args)
        survey = survey_rows(Path(args.prompts))  # the one pass over the prompts before the run
        engine, answer = build_engine(args, args.preflight, survey)
        if args.preflight:
            print(json.dumps(answer), flush=True)
            return 0
        return run(args, engine, say, survey.rows)
    except RegenError as exc:
        return _fail(args.preflight, "config", str(exc), EXIT_USAGE)
    except ImportError as exc:
        name = getattr(exc, "name", None) or str(exc)
        return _fail(
            args.preflight, "missing_module", f"{name} is not installed in {sys.executable}", EXIT_MISSING, module=name
        )


def _fail(preflight: bool, kind: str, message: str, code: int, **extra: Any) -> int:
    """One line: the pre-flight's JSON answer, or `error: ...` on stderr."""
    if preflight:
        print(json.dumps({"ok": False, "error": kind, "message": message, **extra}), flush=True)
    else:
        print(f"error: {message}", file=sys.stderr, flush=True)
    return code


def run(args: argparse.Namespace, engine: Engine, log: Callable[[str], None], total: int) -> int:
    """Open the output, regenerate what is missing of the `total` rows, finish; the exit code."""
    stop, signals = engine.options.stop, []

    def on_signal(signum: int, _frame: object) -> None:
        signals.append(signum)
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    out = Output(Path(args.out))
    try:
        if args.resume and Path(args.out).exists() and not partial_path(Path(args.out)).exists():
            log(f"regen: {args.out} is complete already; nothing to do")
            return 0
        start = out.open()
        batch = engine.options.batch_size
        if start > total:
            raise RegenError(
                f"{out.partial} has {start} rows, {args.prompts} only {total}: the prompts changed; "
                f"remove the partial file and start again"
            )
        if start % batch:
            log(
                f"regen: resuming at row {start}/{total}: batch {start // batch} runs again from row "
                f"{start // batch * batch}, and only its missing rows are written"
            )
        elif start:
            log(f"regen: resuming at row {start}/{total}")
        why = engine.batch_reason
        log(
            f"regen: {total} rows from {args.prompts} -> {args.out}, batch {batch}"
            + (f" ({why})" if why else "")
            + f", {engine.workers} worker(s)"
        )
        metrics = Path(args.metrics) if args.metrics else None
        progress = Progress(total, start, metrics, log, engine.workers, memory=engine.peak_memory_gb)
        batches = read_batches(Path(args.prompts), batch, start // batch) if start < total else iter(())
        failure = regenerate(engine, batches, out, progress, stop)
        if isinstance(failure, (RegenError, ImportError)):
            raise failure
        if failure is not None:
            print(f"error: {failure}", file=sys.stderr, flush=True)
            return EXIT_FAILED
        if out.next_index < total:
            log(f"regen: stopped after {out.next_index}/{total} rows; --resume continues there")
            return 128 + (signals[0] if signals else signal.SIGTERM)
        out.finish()
        if out.failed == total > 0:
            refuse_empty(out, total)
        where = f"; failed rows: {out.errors}" if out.failed else ""
        log(f"regen: done, {total - out.failed} rows in {args.out}{where}")
        return 0
    finally:
        out.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def refuse_empty(out: Output, total: int) -> None:
    """Every row failed (a wrong --model: each request a 404; --max-new-tokens past the context):
    an empty dataset would only fail the run that trains on it, so none is left under the
    output's name (a corrected run may take it) and the run fails (RegenError, exit 2)."""
    with out.errors.open(encoding="utf-8") as fh:
        first = json.loads(fh.readline())
    out.out.unlink()
    raise RegenError(
        f"all {total} rows failed, so no dataset was written (row {first['index']}: {first['reason'][:300]}); "
        f"every row's reason: {out.errors}"
    )


if __name__ == "__main__":
    from .fast_exit import exit_now
    from .lines import whole_lines

    whole_lines()
    exit_now(main())
