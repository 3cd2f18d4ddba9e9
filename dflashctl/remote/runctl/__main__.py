"""`python -m dflashctl_agent.runctl COMMAND WORKDIR ...` in the container (agent.py installs it).

Commands that answer print one JSON object on stdout; `read` streams frames. Layout of a run:
`<workdir>/runs/<run-id>/` with run.json, train.log, metrics.jsonl, exit_code, stop_request, reason
and checkpoints/ (docs/runs.md; several hosts: docs/multihost.md).
"""

import sys

from ..wire import FRAME_ERROR
from .common import RunError, emit
from .listing import cmd_list, cmd_show, cmd_stop
from .pack import cmd_pack
from .read import cmd_read, frame
from .servers import cmd_servers
from .start import cmd_resume, cmd_start


COMMANDS = {
    "start": cmd_start,
    "resume": cmd_resume,
    "list": cmd_list,
    "show": cmd_show,
    "stop": cmd_stop,
    "read": cmd_read,
    "pack": cmd_pack,
    "servers": cmd_servers,
}


def main(argv):
    """Dispatch `COMMAND ARGS...`; error answers go to stdout as JSON (or an X frame)."""
    if not argv or argv[0] not in COMMANDS:
        sys.stderr.write("usage: runctl {%s} WORKDIR ...\n" % ",".join(COMMANDS))
        return 2
    try:
        COMMANDS[argv[0]](*argv[1:])
    except RunError as exc:
        # Answered on stdout (exit 0): the client turns `error` into its own exceptions.
        if argv[0] == "read":
            frame(FRAME_ERROR, exc.answer)
        else:
            emit(exc.answer)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
