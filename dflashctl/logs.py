"""Run logs: tail, and a follow that survives dropped connections and log rotation.

The remote reader (`runctl read`) sends frames: the start position (log inode + byte offset),
log bytes, rotation notices, the latest metrics record, heartbeats, and the run's end. The
client adds up the bytes it has received; after a drop it starts a new reader on a fresh
connection at exactly (inode, offset), so no byte is lost or repeated.
"""

from __future__ import annotations

import codecs
import json
import queue
import struct
import threading
import time
from dataclasses import dataclass
from typing import IO, Any, Callable, Sequence

from rich.console import Console
from rich.live import Live
from rich.text import Text

from .agent import AgentMissing, agent_argv, is_missing, with_agent
from .containers import Target
from .errors import ConnectError, Interrupted, RemoteError
from .output import write_out
from .remote.wire import FRAME_DATA, FRAME_END, FRAME_ERROR, FRAME_METRICS, FRAME_ROTATED, FRAME_START
from .figures import headline_tau
from .runs import EXIT_DETACHED, STATE_STYLE, answer_error, exit_code_for, fmt_duration
from .session import Session
from .transport import Completed, Process

HEADER = struct.Struct(">cI")
CHUNK = 65536

DataSink = Callable[[bytes], None]
MetricsSink = Callable[[dict[str, Any]], None]
NoticeSink = Callable[[str], None]


@dataclass
class Cursor:
    """Which run, which log file (inode) and how far into it the client has received."""

    run_id: str | None = None
    inode: int | None = None
    offset: int = 0
    contacts: int = 0  # readers that answered; a change means the connection works again


@dataclass(frozen=True)
class Ending:
    """How the run ended (or stood, for a tail without follow)."""

    run_id: str
    state: str
    exit_code: int | None


@dataclass(frozen=True)
class Reconnect:
    """How hard to try after a drop: backoff delays, a cap, and when to give up."""

    delays: Sequence[float] = (0.2, 0.5, 1.0, 2.0, 4.0, 8.0)
    max_delay: float = 15.0
    give_up_s: float = 600.0
    stall_s: float = 15.0  # no frame at all (not even a heartbeat) this long: the link is dead

    def delay(self, attempt: int) -> float:
        """Seconds to wait before reconnect attempt number `attempt` (0-based)."""
        return self.delays[attempt] if attempt < len(self.delays) else self.max_delay


class Dropped(Exception):
    """The reader's stream ended or stalled before the run's end frame."""


def parse_frames(buf: bytearray) -> list[tuple[bytes, bytes]]:
    """Take every complete frame off the front of buf."""
    frames = []
    while len(buf) >= HEADER.size:
        kind, size = HEADER.unpack_from(buf)
        if len(buf) < HEADER.size + size:
            break
        frames.append((kind, bytes(buf[HEADER.size : HEADER.size + size])))
        del buf[: HEADER.size + size]
    return frames


def read_log(
    session: Session,
    host: str | None,
    selector: str | None,
    *,
    on_data: DataSink,
    follow: bool = False,
    lines: int = 50,
    since_step: int | None = None,
    on_metrics: MetricsSink | None = None,
    on_notice: NoticeSink | None = None,
    policy: Reconnect = Reconnect(),
    cursor: Cursor | None = None,
) -> Ending:
    """Send a run's log to on_data (last `lines` lines or from step `since_step`); with follow,
    keep going until the run ends, reconnecting after drops. Returns how the run ended."""
    cursor = cursor or Cursor()
    target = session.target(host)
    attempt, down_since = 0, None
    while True:
        position = (cursor.inode, cursor.offset)
        try:
            return read_once(
                target,
                cursor,
                selector,
                follow=follow,
                lines=lines,
                since_step=since_step,
                on_data=on_data,
                on_metrics=on_metrics,
                stall_s=policy.stall_s,
            )
        except (Dropped, ConnectError, OSError, EOFError) as exc:
            if cursor.run_id is None:  # never reached the run: report, do not retry
                raise exc if isinstance(exc, ConnectError) else ConnectError(f"{target.label}: {exc}") from None
            error = exc
        if (cursor.inode, cursor.offset) != position:
            # Log bytes arrived on that connection: a new drop starts a new backoff. A reconnect
            # that only answered (and dropped again) keeps growing it.
            attempt, down_since = 0, None
        down_since = down_since or time.monotonic()
        if time.monotonic() - down_since > policy.give_up_s:
            raise ConnectError(
                f"{target.label}: connection lost for {policy.give_up_s:g} s ({error}); the run goes on; "
                f"re-attach with: dflashctl logs tail {target.host.name} {cursor.run_id} -f"
            )
        delay = policy.delay(attempt)
        if on_notice:
            on_notice(f"connection lost ({error}); reconnecting in {delay:g} s")
        time.sleep(delay)
        attempt += 1
        target = session.reconnect(host)


def read_once(
    target: Target,
    cursor: Cursor,
    selector: str | None,
    *,
    follow: bool,
    lines: int,
    since_step: int | None,
    on_data: DataSink,
    on_metrics: MetricsSink | None,
    stall_s: float,
) -> Ending:
    """One reader on one connection, from the cursor (the agent installed first when the
    container lacks it); raises Dropped if it ends early."""
    resume = cursor.run_id is not None
    args = [
        "read",
        target.host.workdir,
        cursor.run_id or selector or "",
        str(cursor.inode or "") if resume else "",
        str(cursor.offset),
        # A resumed reader continues at the cursor; before the log existed, that is its start.
        "-1" if resume else str(lines),
        "" if resume or since_step is None else str(since_step),
        "1" if follow else "0",
        "1" if on_metrics else "0",
    ]
    return with_agent(
        target, lambda: read_frames(target, cursor, agent_argv(target, "runctl", args), on_data, on_metrics, stall_s)
    )


def read_frames(
    target: Target, cursor: Cursor, argv: list[str], on_data: DataSink, on_metrics: MetricsSink | None, stall_s: float
) -> Ending:
    """Start the reader and apply its frames until the run's end frame (Dropped if it ends early)."""
    proc = target.start(argv)
    try:  # a Ctrl-C from here on, even while the threads start, frees the reader (below)
        chunks: queue.Queue[bytes | None] = queue.Queue()
        stderr = bytearray()
        threading.Thread(target=pump, args=(proc.stdout, chunks), daemon=True).start()
        drainer = threading.Thread(target=drain, args=(proc.stderr, stderr), daemon=True)
        drainer.start()
        buf = bytearray()
        while True:
            try:
                data = chunks.get(timeout=stall_s)
            except queue.Empty:
                raise Dropped(f"nothing received for {stall_s:g} s") from None
            if data is None:
                break
            buf.extend(data)
            for kind, payload in parse_frames(buf):
                ending = handle(target, cursor, kind, payload, on_data, on_metrics)
                if ending is not None:
                    return ending
        if cursor.run_id is None:  # its exit code says why: waited for before the kill below
            raise_start_failure(target, proc, argv, stderr, drainer)
        raise Dropped("connection closed")
    finally:
        proc.kill()  # the reader exits on its own after the end frame; after a drop this frees the channel


def handle(
    target: Target, cursor: Cursor, kind: bytes, payload: bytes, on_data: DataSink, on_metrics: MetricsSink | None
) -> Ending | None:
    """Apply one frame to the cursor and the sinks; the end frame becomes an Ending."""
    if kind == FRAME_DATA:
        on_data(payload)
        cursor.offset += len(payload)
    elif kind == FRAME_START:
        info = json.loads(payload)
        cursor.run_id, cursor.inode, cursor.offset = info["run_id"], info["inode"], info["offset"]
        cursor.contacts += 1
    elif kind == FRAME_ROTATED:
        cursor.inode, cursor.offset = json.loads(payload)["inode"], 0
    elif kind == FRAME_METRICS and on_metrics is not None:
        try:
            on_metrics(json.loads(payload))
        except ValueError:
            pass  # a malformed record only costs one progress update
    elif kind == FRAME_END:
        info = json.loads(payload)
        return Ending(cursor.run_id or "", info["state"], info.get("exit_code"))
    elif kind == FRAME_ERROR:
        raise answer_error(target, json.loads(payload))
    return None


def raise_start_failure(
    target: Target, proc: Process, argv: list[str], stderr: bytearray, drainer: threading.Thread
) -> None:
    """The reader died before saying anything: container stopped, no interpreter, no agent, ..."""
    try:
        code = proc.wait(5)
    except (TimeoutError, ConnectError):
        raise Dropped("no answer from the log reader") from None
    drainer.join(5)  # its last line may still be on the way
    if is_missing(code, bytes(stderr)):
        raise AgentMissing()
    result = Completed(argv, code, b"", bytes(stderr))
    target.raise_for_container(result, argv)
    raise RemoteError(f"{target.label}: cannot read the log: {result.err_line()}")


def pump(stream: IO[bytes], chunks: "queue.Queue[bytes | None]") -> None:
    """Move stdout chunks to the queue; None marks the end (or a dead connection)."""
    try:
        while data := stream.read1(CHUNK):
            chunks.put(data)
    except Exception:  # noqa: BLE001 - a broken channel is just the end of this stream
        pass
    chunks.put(None)


def drain(stream: IO[bytes], into: bytearray) -> None:
    """Keep the last 4 kB of stderr (for error messages) so the channel never blocks on it."""
    try:
        while data := stream.read1(CHUNK):
            into.extend(data)
            del into[:-4096]
    except Exception:  # noqa: BLE001 - see pump
        pass


def attach(
    session: Session,
    host: str | None,
    selector: str | None,
    *,
    follow: bool,
    lines: int,
    since_step: int | None = None,
    out: IO[bytes],
    console: Console | None,
    err: Console,
    policy: Reconnect = Reconnect(),
    final: Callable[[Ending], tuple[Ending, str | None]] | None = None,
) -> int:
    """Show a run's log (following it to the end if asked); returns the CLI's exit code.

    Ctrl-C only detaches: the run goes on, and the message says how to come back. `final` turns
    the followed node's ending into the whole run's (state, reason) for a multi-host run."""
    cursor = Cursor()
    view = LogView(out, console if follow else None)
    try:
        ending = read_log(
            session,
            host,
            selector,
            on_data=view.write,
            follow=follow,
            lines=lines,
            since_step=since_step,
            on_metrics=view.metrics if view.live else None,
            on_notice=lambda msg: err.print(Text(msg, style="dim"), soft_wrap=True),
            policy=policy,
            cursor=cursor,
        )
    except (KeyboardInterrupt, Interrupted):
        view.close()
        run = cursor.run_id or selector or ""
        err.print(
            Text(f"detached; the run goes on. Re-attach: dflashctl logs tail {session.host(host).name} {run} -f"),
            soft_wrap=True,
        )
        return EXIT_DETACHED
    view.close()
    if not follow:
        return 0
    reason = None
    if final is not None:
        ending, reason = final(ending)
    code = f" (exit code {ending.exit_code})" if ending.exit_code not in (None, 0) else ""
    why = f": {reason}" if reason else ""
    err.print(
        Text(f"run {ending.run_id} {ending.state}{code}{why}", style=STATE_STYLE.get(ending.state, "")), soft_wrap=True
    )
    return exit_code_for(ending.state)


class LogView:
    """Where log bytes go: straight to a binary stream, or on a terminal as lines above a live
    progress line fed by the metrics records."""

    def __init__(self, out: IO[bytes], console: Console | None = None):
        self.out = out
        self.console = console
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.partial = ""
        self.progress = Text("waiting for the first metrics record...", style="dim")
        self.live: Live | None = None
        if console is not None:
            self.live = Live(self.progress, console=console, refresh_per_second=4, transient=True)
            self.live.start()

    def write(self, data: bytes) -> None:
        """Show log bytes (whole lines only on a terminal, so the progress line stays below)."""
        if self.live is None:
            write_out(self.out, data)  # a closed stdout (`| head`) ends the follow: OutputClosed
            return
        text = self.partial + self.decoder.decode(data)
        *lines, self.partial = text.split("\n")
        for line in lines:
            self.live.console.print(Text(line), markup=False, highlight=False, soft_wrap=True)

    def metrics(self, record: dict[str, Any]) -> None:
        """Update the progress line from one metrics.jsonl record."""
        if self.live is not None:
            self.progress = progress_text(record)
            self.live.update(self.progress)

    def close(self) -> None:
        """Stop the live line and flush an unfinished last line (safe to call twice)."""
        if self.live is None:
            return
        live, self.live = self.live, None
        live.stop()
        if self.partial:
            live.console.print(Text(self.partial), markup=False, highlight=False, soft_wrap=True)
            self.partial = ""


def progress_text(m: dict[str, Any]) -> Text:
    """`step 120/1000 (12%)  loss 2.3456  teacher-forced accept 3.21  tau ~1.52  12,345 tok/s  ETA 1:02:03`
    (the acceptance is the proxy, `~` the in-training speculative tau as `runs list` marks it), or for
    a data run `rows 120/1000 (12%)  3 failed  12,345 tok/s  ETA 0:04:10`."""
    if "rows_done" in m:
        done, total = m["rows_done"], m.get("rows_total") or 0
        share = f" ({100 * done / total:.0f}%)" if total else ""
        eta = m.get("eta_s")
        rate = "tok/s incl. start-up" if m.get("rate_includes_start_up") else "tok/s"
        return Text(
            f"rows {done}/{total}{share}  {m.get('rows_failed', 0)} failed  {m.get('tokens_per_s') or 0:,.0f} {rate}"
            f"  ETA {fmt_duration(eta) if isinstance(eta, (int, float)) else '-'}",
            style="bold cyan",
        )
    step, total = m.get("step"), m.get("total_steps")
    parts = [f"step {step}/{total} ({100 * step / total:.0f}%)" if step is not None and total else f"step {step}"]
    tau = headline_tau(m, "spec_tau_prompt_mean", "spec_tau")
    for value, shown in (
        (m.get("loss"), "loss {:.4f}"),
        (m.get("acceptance_length"), "teacher-forced accept {:.2f}"),
        (tau, "tau ~{:.2f}"),
        (m.get("tokens_per_s"), "{:,.0f} tok/s"),
    ):
        if isinstance(value, (int, float)):
            parts.append(shown.format(value))
    step_time = m.get("step_time_s")
    if isinstance(step_time, (int, float)) and step is not None and total:
        parts.append(f"ETA {fmt_duration(max(0, total - step) * step_time)}")
    return Text("  ".join(parts), style="bold cyan")
