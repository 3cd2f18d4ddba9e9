"""One smoke test of `dflashctl doctor` in a child process of its own (process group, time
limit), and what its exit and output say: ok, crash (where), hang (where the threads were)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

HANG_DUMP_GRACE_S = 1.0  # faulthandler writes from its signal handler: a second is plenty
# A smoke child's --smoke-timeout counts from the end of its imports (torch and the compiler take
# 3-20 s, more on a busy host, and are not what is tested); the imports themselves get this long.
START_BOUND_S = 600.0


@dataclass
class ChildRun:
    """What a child process left behind: exit status, output, and whether it was killed for time."""

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float
    timeout: float  # the limit that ran out: the run's, or (not started) the bound on the imports
    started: bool = True  # the child got past its imports (run_child's `started` file appeared)


def run_child(
    argv: list[str],
    timeout: float,
    env: dict[str, str] | None = None,
    started: Path | None = None,
    start_bound: float = START_BOUND_S,
) -> ChildRun:
    """Run argv in a new process group; on timeout ask it for its thread stacks, then kill the group.
    With `started`, `timeout` counts from when the child creates that file (after its imports),
    which it must do within `start_bound` seconds."""
    start = time.monotonic()
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    is_started = started is None
    deadline = start + (timeout if is_started else start_bound)
    while True:
        try:
            # Short waits until the child has started, so the clock starts when it does.
            wait = deadline - time.monotonic() if is_started else min(0.2, deadline - time.monotonic())
            out, err = proc.communicate(timeout=max(wait, 0.0))
            return ChildRun(proc.returncode, out, err, False, time.monotonic() - start, timeout)
        except subprocess.TimeoutExpired:
            if not is_started and started.exists():
                is_started, deadline = True, time.monotonic() + timeout
            elif time.monotonic() >= deadline:
                break
    # SIGUSR1 makes faulthandler (registered by the smoke child) print where every thread is.
    _signal_group(proc.pid, signal.SIGUSR1)
    try:
        out, err = proc.communicate(timeout=HANG_DUMP_GRACE_S)
    except subprocess.TimeoutExpired:
        _signal_group(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    return ChildRun(None, out, err, True, time.monotonic() - start, timeout if is_started else start_bound, is_started)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+)(?:, in | in )?(?P<func>\S*)')


def short_path(path: str) -> str:
    """A source path from its package on (`torch/_inductor/x.py`), so reports stay readable."""
    marker = re.search(r"(?:site|dist)-packages/(.+)$", path)
    if marker:
        return marker.group(1)
    if "/dflash_train/" in path:
        return "dflash_train/" + path.rsplit("/dflash_train/", 1)[1]
    return path


def frame_where(file: str, line: str | int, func: str = "") -> str:
    """`file:line in func`, with the file's path shortened."""
    text = f"{short_path(file)}:{line}"
    return f"{text} in {func}" if func else text


Frame = tuple[str, str, str]  # file, line, function


def parse_thread_dump(text: str) -> list[tuple[bool, list[Frame]]]:
    """faulthandler's dump as (is the current thread, its frames innermost first)."""
    threads: list[tuple[bool, list[Frame]]] = []
    for line in text.splitlines():
        if re.match(r"^(Current thread|Thread) 0x[0-9a-f]+", line) or line.startswith("Stack (most recent call first)"):
            threads.append((line.startswith("Current thread"), []))
        elif threads:
            match = _FRAME.match(line)
            if match:
                threads[-1][1].append((match["file"], match["line"], match["func"]))
    return threads


def _in_stdlib(frame: Frame) -> bool:
    stdlib = sysconfig.get_paths()["stdlib"]
    return frame[0].startswith(stdlib) and not re.search(r"(site|dist)-packages", frame[0])


def _describe(frames: list[Frame]) -> str:
    """The innermost frame outside the stdlib (a wait in threading.py says little), and the innermost one."""
    own = next((f for f in frames if not _in_stdlib(f)), frames[0])
    text = frame_where(*own)
    return text if own is frames[0] else f"{text} (innermost: {frame_where(*frames[0])})"


def hang_location(stderr: str) -> str | None:
    """Where a hung child was stuck: every worker thread's position, else the main thread's."""
    threads = [(current, frames) for current, frames in parse_thread_dump(stderr) if frames]
    # The dump is written by the main thread, which only waits for the workers; one stuck worker
    # can hold a lock the others wait on, and which is which is the user's call: show them all.
    workers = [_describe(frames) for current, frames in threads if not current]
    chosen = workers or [_describe(frames) for _, frames in threads]
    return "; ".join(dict.fromkeys(chosen)) or None


def crash_location(stderr: str) -> str | None:
    """Where a fatal signal hit: the crashing ('Current') thread's innermost Python frame."""
    threads = [(current, frames) for current, frames in parse_thread_dump(stderr) if frames]
    threads.sort(key=lambda t: not t[0])
    return _describe(threads[0][1]) if threads else None


def traceback_location(stderr: str) -> tuple[str | None, str | None]:
    """The last exception line of a Python traceback on stderr and its innermost frame."""
    lines = stderr.splitlines()
    starts = [i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent call last)")]
    if not starts:
        return (lines[-1].strip() if lines else None), None
    block = lines[starts[-1] :]
    frames = [m for m in map(_FRAME.match, block) if m]
    message = next((ln for ln in block[1:] if ln and not ln.startswith(" ")), None)
    where = frame_where(frames[-1]["file"], frames[-1]["line"], frames[-1]["func"]) if frames else None
    return message, where


def classify(run: ChildRun) -> dict:
    """Outcome of a smoke child: ok, exception, segfault, signal, hang or error, with where it happened."""
    result = _last_json(run.stdout)
    base = {"seconds": round(run.seconds, 1), "returncode": run.returncode}
    if result is not None:  # it reported; what happened after is worth a note, not a new outcome
        if run.timed_out:
            result["after"] = "then did not exit; process group killed"
        elif run.returncode is not None and run.returncode < 0:
            result["after"] = f"then died of {signal.Signals(-run.returncode).name} while exiting"
        return {**base, **result}
    if run.timed_out:
        waited = (
            f"no result within {run.timeout:g} s of its start"
            if run.started
            else f"not started (importing torch) within {run.timeout:g} s"
        )
        return {
            **base,
            "outcome": "hang",
            "error": f"{waited}; process group killed",
            "where": hang_location(run.stderr),
        }
    if run.returncode is not None and run.returncode < 0:
        name = signal.Signals(-run.returncode).name
        outcome = "segfault" if -run.returncode in (signal.SIGSEGV, signal.SIGBUS) else "signal"
        return {**base, "outcome": outcome, "error": f"killed by {name}", "where": crash_location(run.stderr)}
    message, where = traceback_location(run.stderr)
    return {
        **base,
        "outcome": "exception" if where else "error",
        "error": message or f"exit code {run.returncode}, no result",
        "where": where,
    }


def _last_json(text: str) -> dict | None:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None
