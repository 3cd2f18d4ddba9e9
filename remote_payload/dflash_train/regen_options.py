"""The rules of `regen`'s options, written once: the program checks them (dflash_train.regen), and
`dflashctl data regen` checks them on the user's machine before anything is pushed, loading this
file by path (so it imports the standard library alone)."""

from __future__ import annotations

ENGINES = ("builtin", "openai")


def check_options(
    engine: str,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    batch_size: int | None,
    endpoint: str | None,
    model: str | None,
    concurrency: int,
    retries: int,
    builtin_flags: list[str],
) -> None:
    """ValueError naming the first option that makes no sense whatever the machine; `builtin_flags`:
    the builtin engine's options that were given (--gpus, --preset, --set)."""
    if engine not in ENGINES:
        raise ValueError(f"--engine must be builtin or openai, got {engine!r}")
    if max_new_tokens < 1:
        raise ValueError("--max-new-tokens must be at least 1")
    if not 0 <= temperature < float("inf"):
        raise ValueError(f"--temperature must be 0 (greedy) or positive, got {temperature:g}")
    if not 0 < top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {top_p:g}")
    if batch_size is not None and batch_size < 1:
        raise ValueError("--batch-size must be at least 1")
    if engine == "openai":
        if not endpoint or not model:
            raise ValueError("--engine openai needs --endpoint URL (reachable from the container) and --model NAME")
        if not endpoint.startswith(("http://", "https://")):
            raise ValueError(f"--endpoint must be an http:// or https:// URL, got {endpoint!r}")
        if concurrency < 1 or retries < 0:
            raise ValueError("--concurrency must be at least 1 and --retries 0 or more")
        if builtin_flags:
            raise ValueError(f"{', '.join(builtin_flags)}: for the builtin engine (the server holds the model)")
    elif endpoint or model:
        raise ValueError("--endpoint and --model are for --engine openai")
