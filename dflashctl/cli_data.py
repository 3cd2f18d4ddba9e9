"""`dflashctl data push/list/regen`: datasets in the container (data.py, regen.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional

import click
import typer

if TYPE_CHECKING:  # rich is imported where output is drawn: a piped call never loads it
    from rich.console import Console

    from .data import Pushed

from .cli_common import app_state, complete_host, held, run_name
from .cli_common import data_app
from .cli_common import follow_choice, follow_or_detach
from .errors import UsageError


# --- data --------------------------------------------------------------------------------------


@data_app.command("push")
def data_push(
    ctx: typer.Context,
    host: str = typer.Argument(..., help="Host to send the datasets to.", autocompletion=complete_host),
    files: List[Path] = typer.Argument(..., help="JSONL files (each kept under its file name)."),
    as_name: Optional[str] = typer.Option(None, "--as", help="The dataset's name there (one file only)."),
) -> None:
    """Copy datasets into <workdir>/data/: streamed, hashed, atomic; unchanged files are skipped."""
    from rich.console import Console
    from rich.text import Text
    from .data import push_data
    from .runs import fmt_bytes
    from .tables import counted

    target = app_state(ctx).session().target(host)
    out = Console()
    for done in push_data(target, [f.expanduser() for f in files], as_name):
        verb = "sent" if done.sent else "unchanged"
        out.print(
            Text(
                f"{done.name}: {verb}, {fmt_bytes(done.size)}, {counted(done.rows, 'row')}, sha256 {done.sha256[:12]} "
                f"({_use_hint(target.host.name, done)})"
            ),
            soft_wrap=True,
        )


def _use_hint(host: str, done: Pushed) -> str:
    """How a run uses the dataset, by its rows: the trainer reads token and chat rows; a file with
    prompt rows is for `data regen` or in-training tau prompts (docs/data.md)."""
    from .data import TRAIN_KINDS

    if done.kinds <= TRAIN_KINDS:  # as data regen's own last line says it
        return f"train on it with --set data.source=jsonl --set data.train_path=data:{done.name}"
    out = done.name.removesuffix(".jsonl") + "-regen"
    return (
        f"prompt rows: have the target write the replies with dflashctl data regen {host} --prompts {done.name} "
        f"--out {out}, or use them as --set data.spec_prompts_path=data:{done.name}"
    )


@data_app.command("list")
def data_list(
    ctx: typer.Context,
    host: Optional[str] = typer.Argument(None, help="Host (default host if omitted).", autocompletion=complete_host),
    json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """The datasets on a host: name, kind (a data regen's errors file is no dataset), size, rows, sha256 prefix."""
    from rich.console import Console
    from .data import list_data
    from .runs import fmt_bytes
    from .tables import Column, show

    target = app_state(ctx).session().target(host)
    datasets = list_data(target)
    if json_out:
        typer.echo(json.dumps(datasets, indent=2))
        return
    show(
        Console(),
        [Column("name"), Column("kind"), Column("size", "right"), Column("rows", "right"), Column("sha256")],
        [
            [d["name"], f"errors of {d['errors_of']}" if d.get("errors_of") else "dataset"]
            + [fmt_bytes(d["size"]), str(d["rows"]), d["sha256"][:12]]
            for d in datasets
        ],
        title=f"datasets on {target.label}",
    )


@data_app.command("regen")
def data_regen(
    ctx: typer.Context,
    host: str = typer.Argument(
        ..., help="Host whose container generates (and holds the datasets).", autocompletion=complete_host
    ),
    prompts: Optional[str] = typer.Option(
        None, "--prompts", help="Pushed dataset of prompts: chat `messages`, a `prompt` string or `input_ids` per row."
    ),
    out: Optional[str] = typer.Option(
        None,
        "--out",
        help="Name of the dataset to write (.jsonl is added); a run then uses data.train_path=data:NAME.jsonl.",
    ),
    engine: str = typer.Option(
        "builtin",
        "--engine",
        help="builtin (the trainer's target on the GPUs or CPU: Qwen3, or any causal LM through transformers) "
        "or openai (a server reachable from the container).",
    ),
    gpus: Optional[str] = typer.Option(
        None,
        "--gpus",
        help="builtin: GPU indices like 0,1 (one worker each) or cpu (default: the host's gpus, else every GPU there).",
    ),
    max_new_tokens: int = typer.Option(512, "--max-new-tokens", help="Tokens per response at most."),
    temperature: float = typer.Option(0.0, "--temperature", help="0: greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling (with --temperature > 0)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the sampling (per batch; openai: per row)."),
    thinking: Optional[bool] = typer.Option(
        None, "--thinking/--no-thinking", help="enable_thinking of Qwen3 chat templates (default: the template's)."
    ),
    batch_size: Optional[int] = typer.Option(
        None,
        "--batch-size",
        help="Rows per batch (builtin: the largest up to 256 that fits the GPU memory, 32 on CPU; openai 1).",
    ),
    tokenizer: Optional[str] = typer.Option(
        None, "--tokenizer", help="Tokenizer directory in the container (default: target.path)."
    ),
    preset: Optional[str] = typer.Option(
        None, "--preset", help="builtin: the target's shape preset (tiny, qwen3-8b, llama3-8b, qwen3-30b-a3b)."
    ),
    overrides: List[str] = typer.Option(
        [], "--set", help="builtin: target.path=DIR, another target.* key, run.dtype or run.cpu_threads (repeatable)."
    ),
    endpoint: Optional[str] = typer.Option(None, "--endpoint", help="openai: base URL, e.g. http://127.0.0.1:8000."),
    model: Optional[str] = typer.Option(None, "--model", help="openai: the served model's name."),
    concurrency: int = typer.Option(8, "--concurrency", help="openai: requests at once."),
    retries: int = typer.Option(
        8, "--retries", help="openai: retries of a 429, 5xx, connection error or non-JSON answer."
    ),
    name: Optional[str] = typer.Option(
        None, "--name", callback=run_name, help="A label for the run (default: the output's name)."
    ),
    resume: Optional[str] = typer.Option(
        None, "--resume", metavar="RUN", help="Continue a stopped or failed regen run where it stopped."
    ),
    follow: bool = typer.Option(False, "--follow", help="Stream the log until the run ends (default on a terminal)."),
    detach: bool = typer.Option(False, "--detach", help="Return once the run has started (default in a pipe)."),
    force: bool = typer.Option(False, "--force", help="Start even if a live run uses the same GPUs."),
) -> None:
    """Regenerate responses with the target: a detached run (kind data) writing data/NAME.jsonl."""
    from rich.console import Console
    from rich.text import Text
    from .regen import RegenRequest, check_request

    choice = follow_choice(follow, detach)  # before the host is asked anything
    fixed = ("host", "resume", "follow", "detach", "force")
    given = [
        f"--{p.replace('_', '-')}"
        for p in ctx.params
        if p not in fixed and ctx.get_parameter_source(p) is click.core.ParameterSource.COMMANDLINE
    ]
    if resume is not None and given:
        raise UsageError(f"--resume continues a regen with its own options: drop {', '.join(given)}")
    request = None
    if resume is None:
        if not prompts or not out:
            raise UsageError("data regen needs --prompts NAME and --out NAME (or --resume RUN)")
        request = RegenRequest(
            prompts,
            out,
            engine,
            gpus,
            max_new_tokens,
            temperature,
            top_p,
            seed,
            thinking,
            batch_size,
            tokenizer,
            preset,
            tuple(overrides),
            endpoint,
            model,
            concurrency,
            retries,
        )
        check_request(request)  # before anything is pushed
    session = app_state(ctx).session()
    target = session.target(host)
    err = Console(stderr=True)
    run, verb, dataset = _start_regen(target, request, resume, name=name, force=force, err=err)
    what = f"{verb} regen run {run.run_id} on {target.label}, {held(run.gpus)}, writing data:{dataset}"
    code = follow_or_detach(app_state(ctx), session, target, run.run_id, what, choice, err)
    if code == 0:
        err.print(
            Text(
                f"wrote data:{dataset}; train on it with --set data.source=jsonl --set data.train_path=data:{dataset}"
            ),
            soft_wrap=True,
        )
    raise typer.Exit(code or 0)


def _start_regen(
    target,
    request,
    resume: Optional[str],
    *,
    name: Optional[str],  # type: ignore[no-untyped-def]
    force: bool,
    err: Console,
):
    """Start the regen run (or resume one): (StartedRun, verb, the output dataset's name)."""
    from .regen import datasets_for, start_regen
    from .runs import push_payload, refuse_resume, resume_run, show_run

    if resume is not None:
        # Its record first (its output's name is there): a resume it refuses pushes nothing.
        info = show_run(target, resume, metrics=False)
        refuse_resume(target, info, "data")
        payload_hash = push_payload(target, None, err)
        run = resume_run(target, info["run_id"], payload_hash=payload_hash, force=force, kind="data")
        return run, "resumed", str((info.get("config") or {}).get("out", "?"))
    prompts_name, dataset = datasets_for(target, request)  # before the push: a wrong name changes nothing
    payload_hash = push_payload(target, None, err)
    run = start_regen(target, request, prompts_name, dataset, name=name, force=force, payload_hash=payload_hash)
    return run, "started", dataset
