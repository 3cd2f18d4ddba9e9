"""Faults raised on purpose (`debug.fail_at`, `debug.fail_checkpoint`), for tests of the failure
paths: in a module of their own, so that the code that raises them needs nothing else."""


class InjectedFault(RuntimeError):
    """Raised on purpose by `debug.fail_at` or `debug.fail_checkpoint` (tests of the failure paths)."""
