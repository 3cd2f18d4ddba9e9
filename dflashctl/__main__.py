"""`python -m dflashctl`: the same CLI as the `dflashctl` command."""

from .cli import main

main()
