"""The launcher sent with each call of dflashctl's programs in the container (dflashctl/agent.py).

`python -c <this> ROOT MODULE ARGS...` runs `dflashctl_agent.MODULE` (runctl, ...) of the agent
installed at ROOT (`<workdir>/.agent/<hash>`, ~ expanded here) as `python -m` would, in this
process; without ROOT it says so (EXIT_MISSING, MISSING on stderr) and the client installs it with
`python -c <this> --install ROOT`, the files as JSON ({path: text}) on stdin. Stdlib only, 3.8+.
"""

import json
import os
import runpy
import shutil
import sys

PACKAGE = "dflashctl_agent"
EXIT_MISSING = 87
MISSING = "dflashctl: agent not installed:"
KEEP = 8  # installed versions kept (newest first): several dflashctl versions may share a workdir


def install(root, files):
    """Write the files to a fresh directory beside root and rename it into place: a concurrent
    install of the same hash loses the rename and leaves the winner's copy, equal to its own."""
    parent = os.path.dirname(root)
    stage = "%s.tmp-%d" % (root, os.getpid())
    for rel, text in files.items():
        path = os.path.join(stage, *rel.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
    try:
        os.rename(stage, root)
    except OSError:
        shutil.rmtree(stage, ignore_errors=True)
        if not os.path.isdir(root):
            raise
    prune(parent, root)


def prune(parent, current):
    """Remove all but the KEEP newest versions (never current; a half-written stage of another
    install is left alone). A supervisor still running an old version has its modules loaded."""
    versions = [os.path.join(parent, n) for n in os.listdir(parent) if ".tmp-" not in n]
    versions.sort(key=mtime, reverse=True)
    for old in versions[KEEP:]:
        if old != current:
            shutil.rmtree(old, ignore_errors=True)


def mtime(path):
    """A version's modification time (0 when a concurrent prune removed it meanwhile)."""
    try:
        return os.path.getmtime(path)
    except OSError:
        return 0


def main(argv):
    """`--install ROOT` (files on stdin), else `ROOT MODULE ARGS...`."""
    if argv[0] == "--install":
        install(os.path.expanduser(argv[1]), json.load(sys.stdin))
        return 0
    root = os.path.expanduser(argv[0])
    if not os.path.isdir(os.path.join(root, PACKAGE)):
        sys.stderr.write("%s %s\n" % (MISSING, root))
        return EXIT_MISSING
    sys.path.insert(0, root)
    sys.argv = [argv[1]] + argv[2:]
    runpy.run_module("%s.%s" % (PACKAGE, argv[1]), run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
