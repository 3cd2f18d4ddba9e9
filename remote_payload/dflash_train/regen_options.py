"""The rules of `regen`'s options, written once: the program checks them (dflash_train.regen), and
`dflashctl data regen` checks them on the user's machine before anything is pushed, loading this
file by path (so it imports the standard library alone)."""

from __future__ import annotations

from typing import Any

ENGINES = ("builtin", "openai")


def check_options(opts: Any) -> None:
    """ValueError naming the first option that makes no sense whatever the machine. `opts` has the
    options as attributes, as the program's parsed arguments and the CLI's request both do: engine,
    max_new_tokens, temperature, top_p, batch_size, endpoint, model, concurrency, retries, and the
    builtin engine's gpus (None or "auto" when not given), preset and overrides."""
    engine, endpoint, model = opts.engine, opts.endpoint, opts.model
    if engine not in ENGINES:
        raise ValueError(f"--engine must be builtin or openai, got {engine!r}")
    if opts.max_new_tokens < 1:
        raise ValueError("--max-new-tokens must be at least 1")
    if not 0 <= opts.temperature < float("inf"):
        raise ValueError(f"--temperature must be 0 (greedy) or positive, got {opts.temperature:g}")
    if not 0 < opts.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {opts.top_p:g}")
    if opts.batch_size is not None and opts.batch_size < 1:
        raise ValueError("--batch-size must be at least 1")
    if engine == "openai":
        if not endpoint or not model:
            raise ValueError("--engine openai needs --endpoint URL (reachable from the container) and --model NAME")
        if not endpoint.startswith(("http://", "https://")):
            raise ValueError(f"--endpoint must be an http:// or https:// URL, got {endpoint!r}")
        if opts.concurrency < 1 or opts.retries < 0:
            raise ValueError("--concurrency must be at least 1 and --retries 0 or more")
        given = [
            flag
            for flag, value in (
                ("--gpus", opts.gpus not in (None, "auto")),
                ("--preset", opts.preset),
                ("--set", opts.overrides),
            )
            if value
        ]
        if given:
            raise ValueError(f"{', '.join(given)}: for the builtin engine (the server holds the model)")
    elif endpoint or model:
        raise ValueError("--endpoint and --model are for --engine openai")
