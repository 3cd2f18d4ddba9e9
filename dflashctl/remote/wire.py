"""What the CLI and the supervisor in the container (runctl) must agree on: one copy, both sides.

Imported by the CLI as `dflashctl.remote.wire` and by the runctl package installed in the
container (agent.py); stdlib only, Python 3.8+, and nothing but constants.
"""

RUN_DIR_TOKEN = "{run_dir}"  # replaced by runctl with the run's absolute directory
WORKDIR_TOKEN = "{workdir}"  # replaced by runctl with the workdir, ~ expanded in the container
COMPILE_CACHE = f"{WORKDIR_TOKEN}/cache/compile"  # Inductor/Triton caches kept between runs (and read by the doctor)
BYTECODE_CACHE = f"{WORKDIR_TOKEN}/cache/bytecode"  # torch's compiled bytecode, where its install has none

# runctl gives a program's pre-flight this long (importing torch and initialising CUDA on every
# GPU: seconds, not minutes); the client waits for the start that long plus the lock and the spawn.
PREFLIGHT_TIMEOUT_S = 300.0
START_ANSWER_S = PREFLIGHT_TIMEOUT_S + 30.0

# A run's directory, `<workdir>/runs/<run-id>/` (docs/runs.md).
META = "run.json"
LOG = "train.log"
ROTATED = "train.log.1"
METRICS = "metrics.jsonl"
EXIT = "exit_code"
STOP = "stop_request"
REASON = "reason"  # why the run failed, in words, when the trainer knows (a lost node, ...)
AGREED_STOP = "agreed_stop"  # a node of a run across hosts stopped because another node was asked to
EVAL = "eval.json"  # `dflashctl eval`'s report

# `runctl read` frames: 1 type byte + 4-byte big-endian length + payload.
FRAME_START = b"S"  # {run_id, inode, offset}
FRAME_DATA = b"D"  # log bytes, in order (the client adds up the offset)
FRAME_ROTATED = b"R"  # {inode}: what follows starts at offset 0 of that file
FRAME_METRICS = b"M"  # the latest metrics record (JSON)
FRAME_HEARTBEAT = b"H"  # empty: the reader is alive
FRAME_END = b"E"  # {state, exit_code}
FRAME_ERROR = b"X"  # {error, message, candidates?}

CHECKPOINT_CHOICES = ("none", "latest", "all")  # what `runctl pack` (runs pull) includes of checkpoints/

# Exit codes that are never restarted: success, a bad config or data (2), a missing module (4),
# and a stop (130 SIGINT, 143 SIGTERM). Anything else is a crash or a stall (docs/runs.md).
NO_RESTART = (0, 2, 4, 130, 143)

# The agent (runctl, guard) installed under `<workdir>/.agent/<hash>/` (agent.py): a launcher that
# finds no such directory exits with this code after this line on stderr, and the client installs it.
AGENT_DIR = ".agent"
AGENT_PACKAGE = "dflashctl_agent"
EXIT_AGENT_MISSING = 87
AGENT_MISSING = "dflashctl: agent not installed:"
