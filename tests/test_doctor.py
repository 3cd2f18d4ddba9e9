"""`dflashctl doctor`: how a crashed, segfaulted or hung child is classified, the report's rows,
and the CLI end to end on `local` (CPU) and through real sshd + the pct shim.

Timing (2 CPU cores): compiling the tiny step with mode="default" on CPU takes 25-45 s, so only
one slow-marked test compiles; the others inject a crash and a hang (which fire before any
replica is built; slow too: the hang waits out --smoke-timeout), run the eager policy, or use --quick.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from dflashctl.doctor import SCHEMA, DoctorOptions, parse_report, render_report
from runs_helpers import alive, pids_where, wait_until
from sshd import CLI, SHIM_VMID, _children, run_main_in_process

PAYLOAD = Path(__file__).resolve().parent.parent / "remote_payload"
sys.path.insert(0, str(PAYLOAD))

from dflash_train import doctor as D  # noqa: E402

CHECK_IDS = [
    "python",
    "torch",
    "triton",
    "gpus",
    "driver",
    "capability",
    "inductor_cache",
    "tmp",
    "shm",
    "smoke:off",
    "smoke:default",
    "smoke:cudagraph-trees",
    "smoke:cudagraphs",
    "verdict",
]


# --- classification of one child -------------------------------------------------------------


def child(tmp_path: Path, body: str, timeout: float = 30) -> D.ChildRun:
    """Run a small script (written to a file, so frames have a real path) through run_child."""
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(body))
    return D.run_child([sys.executable, "-X", "faulthandler", str(script)], timeout)


def test_exception_reports_first_line_and_innermost_frame(tmp_path: Path) -> None:
    run = child(
        tmp_path,
        """
        def inner():
            raise ValueError("bad shape\\nsecond line")

        inner()
    """,
    )
    result = D.classify(run)
    assert result["outcome"] == "exception" and result["returncode"] == 1
    assert result["error"] == "ValueError: bad shape"
    assert result["where"] == f"{tmp_path}/child.py:3 in inner"


def test_segfault_reports_the_crashing_frame(tmp_path: Path) -> None:
    run = child(
        tmp_path,
        """
        import ctypes

        def poke():
            ctypes.string_at(0)

        poke()
    """,
    )
    result = D.classify(run)
    assert result["outcome"] == "segfault" and result["error"] == "killed by SIGSEGV"
    assert result["where"].startswith(f"{tmp_path}/child.py:5 in poke (innermost: ")
    assert result["where"].endswith(" in string_at)")


def test_hang_is_killed_with_its_process_group_and_located(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    run = child(
        tmp_path,
        f"""
        import faulthandler, signal, subprocess, threading, time
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        grandchild = subprocess.Popen(["sleep", "300"])
        open({str(pid_file)!r}, "w").write(str(grandchild.pid))

        def stuck():
            time.sleep(300)

        worker = threading.Thread(target=stuck)
        worker.start()
        worker.join()
    """,
        timeout=3,
    )
    result = D.classify(run)
    assert result["outcome"] == "hang" and result["error"].startswith("no result within 3 s")
    assert result["where"] == f"{tmp_path}/child.py:8 in stuck"
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 30  # a bound: the kernel reaps the killed sleep asynchronously
    while alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(grandchild), "the hung child's process group outlived the timeout"


def test_the_smoke_clock_starts_once_the_child_has_imported(tmp_path: Path) -> None:
    """Issue 29: a smoke child's imports (10-20 s of torch on a busy host) are not its test time."""
    started = tmp_path / "started"
    script = tmp_path / "child.py"
    script.write_text(f"import pathlib, time\ntime.sleep(4)  # slow imports\npathlib.Path({str(started)!r}).touch()\n")
    run = D.run_child([sys.executable, str(script)], 3, started=started)  # 4 s of imports > the 3 s limit
    assert not run.timed_out and run.returncode == 0 and run.started


def test_a_child_stuck_before_it_started_is_a_hang_in_its_imports(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text("import threading\nthreading.Event().wait()\n")
    run = D.run_child(
        [sys.executable, "-X", "faulthandler", str(script)], 30, started=tmp_path / "started", start_bound=1
    )
    assert run.timed_out and not run.started
    assert D.classify(run)["error"] == "not started (importing torch) within 1 s; process group killed"


def test_a_printed_result_wins(tmp_path: Path) -> None:
    run = child(
        tmp_path,
        """
        import json
        print(json.dumps({"outcome": "ok", "ms_per_step": [1.5, 1.6], "losses": [2.0, 2.0], "losses_agree": True}))
    """,
    )
    assert D.classify(run) == {
        "seconds": round(run.seconds, 1),
        "returncode": 0,
        "outcome": "ok",
        "ms_per_step": [1.5, 1.6],
        "losses": [2.0, 2.0],
        "losses_agree": True,
    }


def test_a_crash_after_the_result_is_noted(tmp_path: Path) -> None:
    run = child(
        tmp_path,
        """
        import ctypes, json
        print(json.dumps({"outcome": "exception", "error": "RuntimeError: x", "where": "a.py:1"}), flush=True)
        ctypes.string_at(0)
    """,
    )
    result = D.classify(run)
    assert result["outcome"] == "exception" and result["returncode"] == -11
    assert result["after"] == "then died of SIGSEGV while exiting"
    row = D.smoke_check("default", {**result, "devices": ["cpu", "cpu"]}, {"off", "default"})
    assert row.status == "fail" and row.evidence == "RuntimeError: x at a.py:1; then died of SIGSEGV while exiting"


# --- rows --------------------------------------------------------------------------------------


def test_gpu_mismatch_names_the_absent_device_nodes(tmp_path: Path) -> None:
    (tmp_path / "nvidiactl").touch()
    (tmp_path / "nvidia0").touch()
    smi = {
        "gpus": [{"index": 0, "name": "NVIDIA H200"}, {"index": 1, "name": "NVIDIA H200"}],
        "driver": "580",
        "cuda": "13.0",
    }
    row = D.check_gpus(smi, 0, None, dev=tmp_path)
    assert row.status == "fail" and row.result == "2 seen by nvidia-smi, 0 by torch"
    assert "absent: /dev/nvidia-uvm /dev/nvidia1" in row.evidence and "lxc.mount.entry" in row.hint
    assert D.check_gpus(None, 0, None).status == "n/a"


def test_smoke_rows_and_verdict() -> None:
    ok = {
        "outcome": "ok",
        "devices": ["cuda:0", "cuda:1"],
        "ms_per_step": [10.0, 11.0],
        "compile_s": [20.0, 9.0],
        "losses": [0.5, 0.5],
        "losses_agree": True,
    }
    smoke = {
        "off": {**ok, "ms_per_step": [9.0, 9.5]},
        "default": ok,
        "cudagraph-trees": {
            "outcome": "exception",
            "error": "AssertionError: ",
            "where": "torch/_inductor/cudagraph_trees.py:359 in get_obj",
        },
        "cudagraphs": {**ok, "ms_per_step": [5.0, 5.5]},
    }
    allowed = {"off", "default", "cudagraphs"}
    trees = D.smoke_check("cudagraph-trees", smoke["cudagraph-trees"], allowed)
    assert trees.status == "warn" and trees.evidence.endswith("cudagraph_trees.py:359 in get_obj")
    diverged = D.smoke_check("default", {**ok, "losses": [0.1, 1.0], "losses_agree": False}, allowed)
    assert diverged.status == "fail" and "disagree" in diverged.result
    # One replica's NaN agrees with nothing, its own copy included: said as what it is.
    broken = D.smoke_check("default", {**ok, "losses": [float("nan")], "losses_agree": False}, allowed)
    assert broken.status == "fail" and broken.result.startswith("loss not finite")
    verdict = D.verdict_check("cuda", "default", smoke, 2)
    assert verdict.status == "ok" and verdict.result.startswith("trainer uses default")
    assert verdict.result.endswith(
        "launcher (run.launcher auto, 2 GPU(s)): threads for target hidden >= 1024, processes for target hidden < 1024"
    )
    assert D.verdict_check("cuda", "default", smoke, 1).result.endswith(
        "launcher (run.launcher auto, 1 GPU(s)): threads (one device)"
    )
    assert D.verdict_check("cuda", "default", smoke, 4).result.endswith(
        "launcher (run.launcher auto, 4 GPU(s)): processes (at every target width)"
    )
    assert verdict.hint == "run.compile: cudagraphs was 2.0x faster here"
    broken = D.verdict_check("cuda", "default", {**smoke, "default": {"outcome": "hang"}}, 2)
    assert broken.status == "fail" and broken.hint == "set run.compile: cudagraphs (its smoke test passed)"


def test_the_launcher_verdict_says_one_thing_where_every_width_gets_it(monkeypatch) -> None:
    """On a CPU box it read `threads for target hidden >= 1024, threads for target hidden < 1024`."""
    from dflash_train import plan
    from dflash_train.doctor_checks import launcher_verdict

    assert launcher_verdict(0) == "launcher (run.launcher auto, no GPU): threads (one device)"
    cpu = D.verdict_check("cpu", "off", {}, 0)
    assert cpu.result == "trainer uses off (run.compile unset -> off); " + launcher_verdict(0)
    monkeypatch.setattr(plan, "THREADS_KEEP_UP", ((1024, 4), (0, 2)))  # a table where 2 GPUs keep threads
    assert launcher_verdict(2) == ("launcher (run.launcher auto, 2 GPU(s)): threads (at every target width)")
    assert launcher_verdict(3).endswith(": threads for target hidden >= 1024, processes for target hidden < 1024")


def test_inject_spec() -> None:
    assert D.parse_inject("crash:default,hang:off") == {"default": "crash", "off": "hang"}
    with pytest.raises(D.ArgumentError, match="FAULT:POLICY"):
        D.parse_inject("explode:off")
    assert D.parse_gpus("1,0", 2) == [1, 0] and D.parse_gpus(None, 2) == [0, 1]
    for bad in ("2", "0,x"):
        with pytest.raises(D.ArgumentError, match="--gpus"):
            D.parse_gpus(bad, 2)
    assert DoctorOptions(quick=True, inject="hang:off").argv() == [
        "report",
        "--smoke-timeout",
        "120.0",
        "--quick",
        "--inject",
        "hang:off",
    ]


def test_jobs_spec_and_default() -> None:
    assert D.parse_jobs(None) is None and D.parse_jobs("3") == 3
    for bad in ("0", "-1", "x", ""):
        with pytest.raises(D.ArgumentError, match="--jobs"):
            D.parse_jobs(bad)
    # One per 4 CPUs, at most one per policy, at least one: a 2-core CI runner stays sequential.
    assert [D.default_jobs(4, cpus) for cpus in (None, 2, 4, 11, 16, 128)] == [1, 1, 1, 2, 4, 4]
    assert D.default_jobs(2, 128) == 2


@pytest.mark.parametrize(
    "cpu_max, expected",
    [
        (None, 64),
        ("max 100000\n", 64),
        ("200000 100000\n", 2),
        ("150000 100000\n", 2),
        ("50000 100000\n", 1),
        ("garbage", 64),
    ],
)
def test_usable_cpus_honours_a_cgroup_quota(tmp_path, monkeypatch, cpu_max, expected) -> None:
    # A container's quota (docker --cpus 2) caps the compile-pass children, not the host's count.
    monkeypatch.setattr(D.os, "sched_getaffinity", lambda pid: set(range(64)))
    if cpu_max is not None:
        (tmp_path / "cpu.max").write_text(cpu_max)
    assert D.usable_cpus(tmp_path) == expected
    # The client passes even a bad value on: the container side rejects it with exit 2.
    assert DoctorOptions(jobs=0).argv()[-2:] == ["--jobs", "0"] and "--jobs" not in DoctorOptions().argv()


# --- the CLI end to end ------------------------------------------------------------------------


@pytest.fixture
def local_env(tmp_path: Path) -> dict[str, str]:
    """Environment for the CLI with a `local` host whose work directory is under tmp_path."""
    inventory = tmp_path / "hosts.yaml"
    inventory.write_text(
        yaml.safe_dump({"hosts": {"local": {"transport": "local", "workdir": str(tmp_path / "work")}}})
    )
    return {**os.environ, "DFLASHCTL_INVENTORY": str(inventory), "NO_COLOR": "1", "COLUMNS": "250"}


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """Run dflashctl's main() in this process with env as its environment (no signal, pipe or detach
    here: the smoke children run, hang and are killed on the container side); pytest-timeout bounds it."""
    return run_main_in_process(args, env, None)


def rows(doc: dict) -> dict[str, dict]:
    """Report rows by id, after checking the document's shape."""
    assert doc["schema"] == SCHEMA and [c["id"] for c in doc["checks"]] == CHECK_IDS
    for row in doc["checks"]:
        assert set(row) == {"id", "check", "status", "result", "evidence", "hint"}
        assert row["status"] in ("ok", "warn", "fail", "n/a", "skipped")
    return {c["id"]: c for c in doc["checks"]}


@pytest.mark.slow
@pytest.mark.parametrize("jobs", [[], ["--jobs", "2"]], ids=["default-jobs", "jobs-2"])
def test_local_injected_crash_and_hang(local_env: dict[str, str], jobs: list[str]) -> None:
    proc = cli(
        local_env, "doctor", "local", "--json", "--inject", "crash:default,hang:off", "--smoke-timeout", "15", *jobs
    )
    assert proc.returncode == 1, proc.stderr
    doc = json.loads(proc.stdout)
    by_id = rows(doc)
    assert doc["host"] == "local" and doc["devices"] == ["cpu", "cpu"] and doc["ok"] is False
    smoke = {s["policy"]: s for s in doc["smoke"]}
    assert smoke["default"]["outcome"] == "exception" and smoke["default"]["injected"] == "crash"
    assert smoke["default"]["error"] == "InjectedFault: injected fault at build on worker 0 (fail_at=build)"
    assert smoke["default"]["where"].startswith("dflash_train/workers.py:") and smoke["default"]["where"].endswith(
        " in _maybe_fail"
    )
    assert any("injected fault" in line for line in smoke["default"]["stderr_tail"])
    assert smoke["off"]["outcome"] == "hang" and smoke["off"]["returncode"] is None
    assert "in hang_forever" in smoke["off"]["where"]
    assert any("hang_forever" in line for line in smoke["off"]["stderr_tail"])  # the faulthandler dump
    assert by_id["smoke:default"]["status"] == "fail" and by_id["smoke:default"]["result"] == "exception"
    assert by_id["smoke:off"]["status"] == "fail" and by_id["smoke:off"]["result"] == "hang"
    for policy in ("cudagraph-trees", "cudagraphs"):
        assert by_id[f"smoke:{policy}"]["status"] == "n/a"
    for gpu_row in ("gpus", "driver", "capability"):
        assert by_id[gpu_row]["status"] == "n/a"
    assert by_id["verdict"]["status"] == "fail" and by_id["verdict"]["result"].startswith("trainer uses off")
    label = " (compile pass)" if jobs else ""
    assert f"smoke off{label}: hang" in proc.stderr and f"smoke default{label}: exception" in proc.stderr  # streamed
    if jobs:  # both children at once: the second started before the first (a 15 s hang) ended
        assert proc.stderr.index("smoke default (compile pass) on cpu+cpu") < proc.stderr.index(
            "smoke off (compile pass): hang"
        )
        # found in the compile pass: neither is run again for timing
        assert "smoke off on" not in proc.stderr and "smoke default on" not in proc.stderr
        assert by_id["smoke:off"]["evidence"].count("(compile pass)") == 1

    console = Console(record=True, width=250, color_system=None)
    render_report(doc, console)
    table = console.export_text()
    assert "_maybe_fail" in table and "hang_forever" in table
    assert "3 failed: threads: eager, threads: compile default, verdict" in table


def test_local_quick_table(local_env: dict[str, str]) -> None:
    proc = cli(local_env, "doctor", "local", "--quick")
    assert proc.returncode == 0, proc.stderr
    header, *rest = proc.stdout.splitlines()  # in a pipe: plain columns, then each row's evidence and hint
    assert header.split() == ["CHECK", "STATUS", "RESULT"]
    width = header.index("STATUS")
    statuses = {"ok", "warn", "fail", "n/a", "skipped"}
    rows = {
        line[:width].strip(): line[width:]
        for line in rest
        if line[width:].split()[:1] and line[width:].split()[0] in statuses and line[width - 2 : width] == "  "
    }
    assert rows["threads: eager"].split()[0] == "skipped"
    assert rows["threads: reduce-overhead, trees"].split()[0] == "n/a" and rows["GPUs"].split()[0] == "n/a"
    assert rows["verdict"].split(None, 1)[1] == (
        "trainer uses off (run.compile unset -> off); launcher (run.launcher auto, no GPU): threads (one device)"
    )
    assert "\nGPUs: nvidia-smi not found; torch.cuda.device_count() = 0\n" in proc.stdout  # evidence below
    assert "no failures" in proc.stdout


def test_bad_gpu_index_is_a_usage_error(local_env: dict[str, str]) -> None:
    proc = cli(local_env, "doctor", "local", "--quick", "--gpus", "7")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == "error: doctor: --gpus 7: torch sees 0 GPU(s), no index 7"  # once, one line


def test_compile_pass_then_timed_pass(local_env: dict[str, str]) -> None:
    # --jobs 2: both policies first run one step at once (the compile pass); the one that passed is
    # then run again alone for its timing, the one that crashed keeps its compile-pass finding.
    proc = cli(
        local_env,
        "doctor",
        "local",
        "--json",
        "--policies",
        "off,default",
        "--inject",
        "crash:default",
        "--jobs",
        "2",
        "--smoke-timeout",
        "60",
    )
    assert proc.returncode == 1, proc.stderr
    smoke = {s["policy"]: s for s in json.loads(proc.stdout)["smoke"]}
    assert smoke["default"]["outcome"] == "exception" and smoke["default"]["found_in"] == "compile pass"
    assert smoke["off"]["outcome"] == "ok" and smoke["off"]["compile_pass_s"] > 0
    assert len(smoke["off"]["ms_per_step"]) == 2 and smoke["off"]["losses_agree"]
    err = proc.stderr
    both_compiled = max(err.index("smoke off (compile pass): ok"), err.index("smoke default (compile pass): exception"))
    assert both_compiled < err.index("smoke off on cpu+cpu")  # the timed pass comes after the compile pass
    assert "smoke default on cpu+cpu" not in err


def test_bad_jobs_is_a_usage_error(local_env: dict[str, str]) -> None:
    proc = cli(local_env, "doctor", "local", "--quick", "--jobs", "0")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == "error: doctor: --jobs takes how many smoke tests run at once, 1 or more, got '0'"
    # The container side's answer is that one line.
    direct = subprocess.run(
        [sys.executable, "-m", "dflash_train.doctor", "report", "--quick", "--jobs", "0"],
        capture_output=True,
        text=True,
        env=D.child_env(),
        timeout=120,
    )
    assert direct.returncode == 2 and direct.stdout == ""
    assert direct.stderr.splitlines() == [
        "doctor usage error: --jobs takes how many smoke tests run at once, 1 or more, got '0'"
    ]


def test_shim_host_quick(sshd_host) -> None:  # type: ignore[no-untyped-def]
    # --quick: the smoke tests are the same code as on `local` (tested above); this checks the
    # push, the bootstrap through ssh + pct exec, and the JSON coming back, in ~10 s of CI time.
    sshd_host.reset()
    proc = sshd_host.run_cli("doctor", "shim", "--quick", "--json", timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    by_id = rows(doc)
    assert doc["host"] == "shim" and by_id["python"]["evidence"] == sys.executable
    assert by_id["smoke:default"]["status"] == "skipped" and by_id["verdict"]["status"] == "ok"
    assert (sshd_host.container_dir(200) / "work" / "payload" / "dflash_train" / "doctor.py").is_file()
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:  # the user's own setting would win, as in the trainer
        # The cache the runs compile into, not torch's default under /tmp (whose hint sent users
        # to TORCHINDUCTOR_CACHE_DIR although dflashctl's runs keep their cache in the workdir).
        cache = sshd_host.container_dir(200) / "work" / "cache" / "compile"
        assert by_id["inductor_cache"]["evidence"].startswith(f"{cache} (run.compile_cache_dir of dflashctl's runs)")
        assert not by_id["inductor_cache"].get("hint")


def _doctor_processes(cache: Path) -> list[int]:
    """The processes whose command line names cache (the report, the guard around it) and their children."""
    named = pids_where(lambda args: str(cache).encode() in b"\0".join(args))
    return named + [kid for pid in named for kid in _children(pid)]


def _smoke_started(pids: list[int]) -> bool:
    return any(b"dflash_train.doctor\0smoke" in _cmdline(pid) for pid in pids)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


@pytest.mark.parametrize("where", ["shim", "local"])
def test_ctrl_c_stops_the_doctor_and_its_smoke_tests_on_the_host(sshd_host, local_env, tmp_path, where) -> None:
    """Ctrl-C of `doctor` over SSH left the report and its smoke test running on the host (closing the
    channel signals nothing), here one that hangs until --smoke-timeout; on `local` the smoke test too."""
    sshd_host.reset()
    env = sshd_host.env if where == "shim" else local_env
    work = sshd_host.container_dir(SHIM_VMID) / "work" if where == "shim" else tmp_path / "work"
    argv = ["doctor", where, "--policies", "off", "--inject", "hang:off", "--smoke-timeout", "600"]
    proc = subprocess.Popen(
        [*CLI, *argv], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    pids: list[int] = []
    try:
        while b"smoke off" not in (line := proc.stderr.readline()):
            assert line, proc.stderr.read()
        pids = wait_until(lambda: _smoke_started(found := _doctor_processes(work / "cache" / "compile")) and found)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        assert (proc.returncode, err) == (130, b"error: interrupted\n")
        wait_until(lambda: not any(alive(p) for p in pids), 60, f"{pids} to end")
    finally:
        proc.kill()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_parse_report_ignores_noise() -> None:
    doc = {"schema": SCHEMA, "ok": True}
    assert parse_report(b"warning: something\n" + json.dumps(doc).encode() + b"\n") == doc
    assert parse_report(b"{not json\n") is None and parse_report(b'{"schema": "other"}\n') is None


@pytest.mark.slow
def test_local_compile_default_in_threads(local_env: dict[str, str]) -> None:
    proc = cli(local_env, "doctor", "local", "--json", "--policies", "off,default", "--smoke-timeout", "300")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    by_id = rows(doc)
    smoke = {s["policy"]: s for s in doc["smoke"]}
    for policy in ("off", "default"):
        assert smoke[policy]["outcome"] == "ok" and smoke[policy]["losses_agree"], smoke[policy]
        assert all(ms > 0 for ms in smoke[policy]["ms_per_step"])
        assert by_id[f"smoke:{policy}"]["status"] == "ok"
    assert by_id["verdict"]["status"] == "ok"
