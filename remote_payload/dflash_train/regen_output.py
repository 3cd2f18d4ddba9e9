"""Where `dflash_train.regen` writes: the partial file in input order (fsynced per batch, read
back on resume, split into the output and the errors file when complete), and the progress
lines and records. Standard library only."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable

from .regen_rows import Done, RegenError

LOG_EVERY_S = 1.0  # progress lines at most this often (and at the end)


def errors_path(out: Path) -> Path:
    """`<stem>.errors.jsonl` beside the output."""
    stem = out.name[: -len(".jsonl")] if out.name.endswith(".jsonl") else out.name
    return out.with_name(f"{stem}.errors.jsonl")


def partial_path(out: Path) -> Path:
    """The hidden partial file beside the output."""
    return out.with_name(f".{out.name}.partial")


class Output:
    """The partial file: results in input order, each batch fsynced; split into the output (and
    errors file) when complete. One writer at a time (an flock on the partial)."""

    def __init__(self, out: Path):
        self.out, self.partial, self.errors = out, partial_path(out), errors_path(out)
        self.next_index = 0  # rows 0..next_index-1 are in the partial
        self.failed = 0
        self.fh = None

    def open(self) -> int:
        """Open the partial (read back what an interrupted run left in it); returns the next row index."""
        import fcntl

        self.fh = open(self.partial, "a+b")
        try:
            fcntl.flock(self.fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise RegenError(f"another regen is writing {self.partial}") from None
        good = self._read_back()
        if good < self.fh.seek(0, os.SEEK_END):
            self.fh.truncate(good)  # a torn last line: its batch is redone
        return self.next_index

    def _read_back(self) -> int:
        """Check the partial's rows (indices 0, 1, 2, ...); returns the byte offset after the last whole one."""
        self.fh.seek(0)
        offset = 0
        for line in self.fh:
            try:
                row = json.loads(line) if line.endswith(b"\n") else None
            except ValueError:
                row = None
            if not isinstance(row, dict):
                if self.fh.read(1):
                    raise RegenError(f"{self.partial}: line {self.next_index + 1} is damaged (not the last line)")
                break
            if row.get("index") != self.next_index:
                raise RegenError(f"{self.partial}: row {self.next_index} has index {row.get('index')}")
            self.failed += "_error" in row
            self.next_index += 1
            offset += len(line)
        return offset

    def write(self, results: list[Done]) -> None:
        """Append the results not yet written (a redone batch repeats none), flushed and fsynced."""
        lines = []
        for done in results:
            if done.index < self.next_index:
                continue
            if done.index != self.next_index:
                raise RuntimeError(f"result {done.index} out of order (expected {self.next_index})")
            record = {"index": done.index, "_error": done.error} if done.error is not None else done.row
            lines.append(json.dumps(record, ensure_ascii=False) + "\n")
            self.failed += done.error is not None
            self.next_index += 1
        if lines:
            self.fh.write("".join(lines).encode("utf-8"))
            self.fh.flush()
            os.fsync(self.fh.fileno())

    def finish(self) -> None:
        """Split the complete partial into the output and the errors file, then remove it."""
        tmp_out, tmp_err = (
            self.out.with_name(f".{self.out.name}.tmp"),
            self.errors.with_name(f".{self.errors.name}.tmp"),
        )
        self.fh.seek(0)
        with open(tmp_out, "wb") as out, open(tmp_err, "wb") as err:
            for line in self.fh:
                row = json.loads(line)
                if "_error" in row:
                    err.write(
                        (
                            json.dumps({"index": row["index"], "reason": row["_error"]}, ensure_ascii=False) + "\n"
                        ).encode("utf-8")
                    )
                else:
                    out.write(line)
            for fh in (out, err):
                fh.flush()
                os.fsync(fh.fileno())
        if self.failed:
            os.replace(tmp_err, self.errors)
        else:
            os.remove(tmp_err)
            if self.errors.exists():
                os.remove(self.errors)  # left by an earlier run under this name
        os.replace(tmp_out, self.out)
        os.remove(self.partial)
        self.close()

    def close(self) -> None:
        """Release the partial (and its lock)."""
        if self.fh is not None:
            self.fh.close()
            self.fh = None


# --- progress -------------------------------------------------------------------------------------


class Progress:
    """Rows done/total, tokens/s and ETA: a log line at most every second, and a metrics record.

    The rate is measured from the end of the first round of batches (one per worker) on: before
    it the program was starting (imports, the target's build, compiles), which says nothing of
    how fast the rest goes. Until then the line gives the rate since the start, marked as such."""

    def __init__(
        self,
        total: int,
        start: int,
        metrics: Path | None,
        log: Callable[[str], None],
        workers: int = 1,
        clock: Callable[[], float] = time.monotonic,
        memory: Callable[[], float | None] = lambda: None,
    ):
        self.total, self.start, self.metrics, self.log = total, start, metrics, log
        self.workers, self.clock, self.memory = workers, clock, memory
        self.t0 = clock()
        self.tokens = 0
        self.batches = 0
        self.round: tuple[float, int, int] | None = None  # (time, rows done, tokens) when the first round was in
        self.last = float("-inf")

    def update(self, done: int, failed: int, new_tokens: int, final: bool = False) -> None:
        """Count a written batch (new_tokens 0 and final: the run's end); log when due (or final)."""
        self.tokens += new_tokens
        now = self.clock()
        if not final:
            self.batches += 1
            if self.batches == self.workers:
                self.round = (now, done, self.tokens)
        if not final and now - self.last < LOG_EVERY_S:
            return
        self.last = now
        # Steady once a batch is in after the first round; a run whose rows all fit in that round never is.
        steady = self.round is not None and now > self.round[0] and self.tokens > self.round[2]
        since, rows0, tokens0 = self.round if steady else (self.t0, self.start, 0)
        elapsed = max(now - since, 1e-9)
        rate = (done - rows0) / elapsed
        eta = (self.total - done) / rate if rate > 0 else None
        tok_s = (self.tokens - tokens0) / elapsed
        share = 100 * done / self.total if self.total else 100.0
        label = "tok/s" if steady else "tok/s incl. start-up"
        self.log(
            f"regen: {done}/{self.total} rows ({share:.0f}%), {failed} failed, {tok_s:,.0f} {label}, "
            f"ETA {duration(eta)}"
        )
        if self.metrics is not None:
            record = {
                "rows_done": done,
                "rows_total": self.total,
                "rows_failed": failed,
                "tokens_per_s": round(tok_s, 1),
                "rate_includes_start_up": not steady,
                "tokens_per_s_since_start": round(self.tokens / max(now - self.t0, 1e-9), 1),
                "eta_s": None if eta is None else round(eta, 1),
                "gpu_mem_gb": None if (peak := self.memory()) is None else round(peak, 2),  # the peak so far
                "time": time.time(),
            }
            with self.metrics.open("a") as fh:
                fh.write(json.dumps(record) + "\n")


def duration(seconds: float | None) -> str:
    """`1:02:03` / `4:05`, or `-`."""
    if seconds is None:
        return "-"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"
