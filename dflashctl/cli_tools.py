"""`dflashctl tunnel`, `eval` and `doctor`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from .cli_common import HOST_THEN_RUN, RUN_ARG, app, app_state, complete_host, run_target, word_is_host_or_run
from .errors import Interrupted, RemoteError


# --- tunnel ------------------------------------------------------------------------------------


@app.command("tunnel")
def tunnel_cmd(
    ctx: typer.Context,
    host: str = typer.Argument(..., help="Host whose container has the port.", autocompletion=complete_host),
    ports: str = typer.Argument(..., help="PORT in the container, or PORT:LOCAL to listen on another local port."),
) -> None:
    """Forward 127.0.0.1:LOCAL here to PORT inside the container (a served drafter, a dashboard)."""
    from rich.console import Console
    from rich.text import Text
    from .tunnel import Tunnel, parse_ports

    remote, local = parse_ports(ports)
    target = app_state(ctx).session().target(host)
    err = Console(stderr=True)
    tunnel = Tunnel(target, remote, local, notice=lambda line: err.print(Text(line, style="dim"), soft_wrap=True))
    err.print(
        Text(f"forwarding 127.0.0.1:{tunnel.local_port} -> port {remote} in {target.label} (Ctrl-C closes it)"),
        soft_wrap=True,
    )
    try:
        tunnel.serve()
    except (Interrupted, KeyboardInterrupt):
        pass
    finally:
        tunnel.close()
    err.print(Text("tunnel closed"), soft_wrap=True)


# --- eval --------------------------------------------------------------------------------------


@app.command("eval")
def eval_cmd(
    ctx: typer.Context,
    host: Optional[str] = typer.Argument(None, **HOST_THEN_RUN),
    run: Optional[str] = typer.Argument(None, **RUN_ARG),
    prompts: Optional[Path] = typer.Option(
        None,
        "--prompts",
        help="JSONL of input_ids, messages (chat) or prompt (text) rows (default: the run's own held-out prompts); "
        "the report goes to eval-<FILE's stem>.json beside the default eval's eval.json.",
    ),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="Tokens to generate per prompt."),
    count: int = typer.Option(16, "--count", help="At most this many prompts."),
    temperature: float = typer.Option(0.0, "--temperature", help="0: greedy, checked lossless; > 0: sampled."),
    gpus: Optional[str] = typer.Option(
        None, "--gpus", help="The one GPU to decode on, e.g. 3, or cpu (default: the run's first device)."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the report (eval.json) as JSON."),
    baseline: bool = typer.Option(
        True, "--baseline/--no-baseline", help="Also decode by prompt lookup, the free baseline (greedy only)."
    ),
) -> None:
    """Measure a finished run's real acceptance length (tau) and speedup by speculative decoding."""
    from rich.console import Console
    from rich.text import Text
    from .evaluation import render, run_eval

    session = app_state(ctx).session()
    target, host, run = run_target(session, host, run)
    err = Console(stderr=True)
    with word_is_host_or_run(session, host, run):
        report = run_eval(
            target,
            run,
            prompts.expanduser() if prompts else None,
            max_new_tokens,
            count,
            temperature,
            progress=lambda line: err.print(Text(line, style="dim"), soft_wrap=True),
            gpus=gpus,
            baseline=baseline,
        )
    if json_out:
        typer.echo(json.dumps(report, indent=2))
    else:
        render(report, Console())
    for what, figures in (("speculative", report), ("prompt-lookup", report.get("baseline") or {})):
        if figures.get("identical") is False and not figures.get("differences_are_ties"):
            raise RemoteError(
                f"run {report['run_id']}: the {what} output differs from the target's greedy "
                f"decode (a bug: please report it with eval.json)"
            )


# --- doctor ------------------------------------------------------------------------------------


@app.command("doctor")
def doctor_cmd(
    ctx: typer.Context,
    host: Optional[str] = typer.Argument(
        None,
        help="Host to diagnose (default host if omitted).",
        autocompletion=complete_host,
    ),
    gpus: Optional[str] = typer.Option(
        None, "--gpus", help="GPU indices for the smoke tests, e.g. 0,1 (default: the host's gpus, else all)."
    ),
    quick: bool = typer.Option(False, "--quick", help="Skip the threaded compile smoke tests."),
    json_out: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    policies: Optional[str] = typer.Option(
        None, "--policies", help="Smoke-test only these policies: off,default,cudagraph-trees,cudagraphs."
    ),
    smoke_timeout: float = typer.Option(
        120.0, "--smoke-timeout", help="Seconds per smoke test, after its imports, before it counts as a hang."
    ),
    steps: int = typer.Option(
        0,
        "--steps",
        show_default=False,  # 0: decided by the device (doctor.py)
        help="Timed steps per smoke test (default 30 on GPU, 3 on CPU).",
    ),
    jobs: Optional[int] = typer.Option(
        None, "--jobs", help="Smoke tests run at once (default: one per 4 CPUs of the host)."
    ),
    inject: Optional[str] = typer.Option(None, "--inject", hidden=True, help="Test hook, see docs/doctor.md."),
) -> None:
    """Diagnose a host: GPUs, driver, torch, caches, and threaded torch.compile smoke tests."""
    from rich.console import Console
    from rich.text import Text
    import json

    from .doctor import DoctorOptions, render_report, run_doctor

    target = app_state(ctx).session().target(host)
    err = Console(stderr=True)
    options = DoctorOptions(quick, gpus, policies, smoke_timeout, steps, inject, jobs)
    doc = run_doctor(target, options, progress=lambda line: err.print(Text(line, style="dim")))
    if json_out:
        typer.echo(json.dumps(doc, indent=2))
    else:
        render_report(doc, Console())
    raise typer.Exit(0 if doc["ok"] else 1)


# --- entry point -------------------------------------------------------------------------------
