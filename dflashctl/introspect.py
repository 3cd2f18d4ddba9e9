"""`dflashctl inspect`: read remote PyTorch source (lines, symbols, grep) and live config.

Source reads never import torch remotely: `remote/introspect_source.py` maps the dotted name to a
file with the standard library only and returns the file's bytes, or just "unchanged" when the
client's cache already holds a copy with the same SHA-256. Line numbers are those of
`inspect.getsource(module).splitlines()`. Live config (`inductor.config`) is the one form that
imports torch, in `remote/introspect_config.py`.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from .containers import Target, remote_script
from .errors import ContainerError, NotFoundError, RemoteError, UsageError
from .inventory import HostSpec

MARKER = b"@@dflashctl-inspect@@ "
SOURCE_TIMEOUT = 120.0
CONFIG_TIMEOUT = 600.0

# Short names for the modules people read most; docs/inspect.md lists them.
ALIASES = {
    "compile_fx": "torch._inductor.compile_fx",
    "cudagraph_trees": "torch._inductor.cudagraph_trees",
    "cudagraph_utils": "torch._inductor.cudagraph_utils",
    "codecache": "torch._inductor.codecache",
    "graph": "torch._inductor.graph",
    "scheduler": "torch._inductor.scheduler",
    "lowering": "torch._inductor.lowering",
    "ir": "torch._inductor.ir",
    "utils": "torch._inductor.utils",
    "inductor": "torch._inductor",
    "inductor.config": "torch._inductor.config",
    "convert_frame": "torch._dynamo.convert_frame",
    "eval_frame": "torch._dynamo.eval_frame",
    "output_graph": "torch._dynamo.output_graph",
    "guards": "torch._dynamo.guards",
    "symbolic_convert": "torch._dynamo.symbolic_convert",
    "dynamo": "torch._dynamo",
    "dynamo.config": "torch._dynamo.config",
    "aot_autograd": "torch._functorch.aot_autograd",
    "functorch.config": "torch._functorch.config",
}
# Modules installed with torch.utils._config_module: shown as live key/value listings.
CONFIG_MODULES = ("torch._inductor.config", "torch._dynamo.config", "torch._functorch.config")


# --- targets and line ranges ---------------------------------------------------------------------


@dataclass(frozen=True)
class LineRange:
    """Inclusive 1-based line bounds; end None means to the end of the file."""

    start: int
    end: int | None


def parse_lines(spec: str | None, context: int = 0) -> LineRange | None:
    """Parse `A:B`, `A:+N` (A and the N lines after it) or `A` (widened by context on both sides)."""
    if spec is None:
        return None
    match = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\+?)(\d*)\s*)?", spec)
    if not match:
        raise UsageError(f"--lines must look like 1825:1888, 1850:+20 or 1850, got {spec!r}")
    start = int(match.group(1))
    if start < 1:
        raise UsageError("--lines starts at line 1")
    if match.group(3):
        count = int(match.group(3))
        end = start + count if match.group(2) else count
    elif match.group(0).strip().endswith(":"):
        end = None
    else:
        return LineRange(max(1, start - context), start + context)
    if end is not None and end < start:
        raise UsageError(f"--lines {spec}: the end is before the start")
    return LineRange(start, end)


def expand_alias(target: str) -> str:
    """Replace a known alias at the start of a dotted target by its module path."""
    for alias in sorted(ALIASES, key=len, reverse=True):
        if target == alias or target.startswith(alias + "."):
            return ALIASES[alias] + target[len(alias) :]
    return target


def config_split(dotted: str) -> tuple[str, str] | None:
    """(config module, key prefix) when dotted names a config module or one of its keys."""
    for module in CONFIG_MODULES:
        if dotted == module or dotted.startswith(module + "."):
            return module, dotted[len(module) + 1 :]
    return None


def suggest(word: str, candidates: Sequence[str], prefix: str = "") -> str:
    """` (did you mean a, b?)` for close matches (each shown with prefix), else ''."""
    import difflib

    close = difflib.get_close_matches(word, list(candidates), n=3, cutoff=0.6)
    return f" (did you mean {', '.join(prefix + c for c in close)}?)" if close else ""


# --- client-side cache -------------------------------------------------------------------------


def cache_root() -> Path:
    """`$XDG_CACHE_HOME/dflashctl/inspect`, else `~/.cache/dflashctl/inspect`."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dflashctl" / "inspect"


class SourceCache:
    """Remote source files by content hash, per host and container, plus module -> hash refs."""

    def __init__(self, root: Path, host: HostSpec):
        # `pct-200`, `docker-trainer`, or `host` when commands run on the host itself.
        container = "host" if host.container.runtime == "none" else host.container.describe().replace(" ", "-")
        self.dir = root / _safe(host.name) / _safe(container)

    def known(self, modules: Sequence[str]) -> dict[str, str]:
        """{module: sha256} for the modules whose file we hold a copy of."""
        found = {}
        for module in modules:
            ref = self.dir / "refs" / module
            if ref.is_file():
                sha = ref.read_text().strip()
                if (self.dir / "blobs" / sha).is_file():
                    found[module] = sha
        return found

    def load(self, sha: str) -> bytes | None:
        """The cached bytes with this hash, or None if missing or damaged."""
        try:
            data = (self.dir / "blobs" / sha).read_bytes()
        except OSError:
            return None
        return data if hashlib.sha256(data).hexdigest() == sha else None

    def store(self, module: str, sha: str, data: bytes) -> None:
        """Record the bytes and module -> sha (atomically, so readers never see halves)."""
        _atomic_write(self.dir / "blobs" / sha, data)
        _atomic_write(self.dir / "refs" / module, sha.encode())


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# --- source reads ------------------------------------------------------------------------------


@dataclass
class SourceFile:
    """One remote module file as resolved remotely, with its bytes when asked for."""

    header: dict[str, Any]
    data: bytes | None
    cache_hit: bool
    received: int  # file-content bytes that crossed the wire for this read


def prefixes(dotted: str) -> list[str]:
    """`a`, `a.b`, `a.b.c` for `a.b.c`: every name the module part of a target could be."""
    parts = dotted.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def fetch_source(target: Target, dotted: str, cache: SourceCache, *, content: bool = True) -> SourceFile:
    """Resolve dotted remotely in one command; file bytes come from the cache when unchanged."""
    have = cache.known(prefixes(dotted)) if content else {}
    header, body = _ask(target, dotted, have, content)
    if "error" in header:
        raise _source_error(target, dotted, header)
    if not content:
        return SourceFile(header, None, False, 0)
    if header["sent"]:
        cache.store(header["module"], header["sha256"], body)
        return SourceFile(header, body, False, len(body))
    data = cache.load(header["sha256"])
    if data is None:  # cache damaged between known() and load(): ask again, without claims
        header, body = _ask(target, dotted, {}, True)
        cache.store(header["module"], header["sha256"], body)
        return SourceFile(header, body, False, len(body))
    return SourceFile(header, data, True, 0)


def _ask(target: Target, dotted: str, have: dict[str, str], content: bool) -> tuple[dict[str, Any], bytes]:
    request = json.dumps({"target": dotted, "have": have, "content": content})
    result = target.python("introspect_source", [request], flags=["-S"], timeout=SOURCE_TIMEOUT)
    return _split_reply(target, result.stdout, result)


def _split_reply(target: Target, stdout: bytes, result: Any) -> tuple[dict[str, Any], bytes]:
    """Header dict and trailing bytes of a remote script's reply."""
    at = stdout.find(MARKER)
    if at < 0 or not result.ok:
        raise RemoteError(f"{target.label}: inspect failed: {result.err_line()}")
    line_end = stdout.find(b"\n", at)
    header = json.loads(stdout[at + len(MARKER) : line_end])
    return header, stdout[line_end + 1 :]


def _source_error(target: Target, dotted: str, header: dict[str, Any]) -> Exception:
    """Turn the remote script's error header into the one-line error the user sees."""
    kind, module = header["error"], header.get("module", "")
    rest = header.get("rest") or []
    if kind == "no_module":
        if module == "torch":
            return ContainerError(f"{target.label}: torch is not installed for {target.host.interpreter}")
        return NotFoundError(f"module not found: {module}{suggest(module, list(ALIASES))}")
    if kind == "no_source" and rest:
        return _missing_module(module, rest[0], header.get("children", []))
    if kind == "no_source":
        if header.get("builtin"):
            return NotFoundError(f"no Python source for {module}: it is built into the interpreter")
        what = f"a compiled extension ({header['file']})" if header.get("file") else "a namespace package"
        return NotFoundError(f"no Python source for {module}: it is {what}")
    if kind == "no_symbol":
        symbol = header["symbol"]
        if header.get("is_package") and "." not in symbol:
            return _missing_module(module, symbol, header.get("children", []) + header.get("candidates", []))
        last = symbol.rsplit(".", 1)[-1]
        return NotFoundError(
            f"symbol not found: {symbol} in {module} ({header['file']}){suggest(last, header.get('candidates', []))}"
        )
    return RemoteError(f"{target.label}: cannot read {dotted}: {header.get('message', kind)}")


def _missing_module(package: str, name: str, siblings: Sequence[str]) -> NotFoundError:
    return NotFoundError(f"module not found: {package}.{name}{suggest(name, siblings, package + '.')}")


def source_lines(data: bytes) -> list[str]:
    """Lines of `inspect.getsource(module).splitlines()` for a file's bytes.

    linecache reads with tokenize.open (coding cookie or BOM, universal newlines) and adds a final
    newline; splitlines() then also breaks on \\f, \\v, \\x1c-\\x1e, \\x85, \\u2028 and \\u2029.
    """
    import tokenize

    encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    text = io.TextIOWrapper(io.BytesIO(data), encoding, line_buffering=True).read()
    return text.splitlines()


@dataclass
class SourceView:
    """What one source read shows: numbered lines plus where they came from."""

    host: str
    target: str
    module: str
    file: str
    package: str | None
    version: str | None
    sha256: str
    total: int
    lines: list[tuple[int, str]]
    symbol: str | None = None
    span: tuple[int, int] | None = None
    grep: str | None = None
    context: int = 0
    matches: list[int] = field(default_factory=list)
    cache_hit: bool = False
    received: int = 0

    def to_json(self) -> dict[str, Any]:
        """The --json form."""
        matched = set(self.matches)
        return {
            "host": self.host,
            "target": self.target,
            "module": self.module,
            "file": self.file,
            "package": self.package,
            "version": self.version,
            "sha256": self.sha256,
            "total_lines": self.total,
            "symbol": self.symbol,
            "span": list(self.span) if self.span else None,
            "grep": self.grep,
            "matches": self.matches,
            "lines": [{"n": n, "text": t, **({"match": n in matched} if self.grep else {})} for n, t in self.lines],
            "cache": {"hit": self.cache_hit, "content_bytes_received": self.received},
        }


def read_source(
    target: Target,
    dotted: str,
    cache: SourceCache,
    *,
    lines: LineRange | None = None,
    grep: str | None = None,
    context: int = 0,
) -> SourceView:
    """Lines of a module or symbol, optionally bounded by lines and filtered by a regex."""
    pattern = _compile(grep)
    fetched = fetch_source(target, dotted, cache)
    header = fetched.header
    assert fetched.data is not None
    try:
        all_lines = source_lines(fetched.data)
    except (SyntaxError, UnicodeDecodeError) as exc:  # inspect.getsource fails on these files too
        raise NotFoundError(f"cannot decode {header['file']}: {exc}") from None
    total = len(all_lines)
    span = tuple(header["span"]) if header.get("span") else None
    if span and lines:
        raise UsageError(f"{dotted} names a symbol (lines {span[0]}-{span[1]}); drop --lines or name the module")
    first, last = span or _bounds(lines, total, header["file"])
    if pattern is None:
        picked = list(range(first, last + 1))
        matches: list[int] = []
    else:
        matches = [n for n in range(first, last + 1) if pattern.search(all_lines[n - 1])]
        picked = _with_context(matches, context, first, last)
    return SourceView(
        host=target.host.name,
        target=dotted,
        module=header["module"],
        file=header["file"],
        package=header.get("package"),
        version=header.get("version"),
        sha256=header["sha256"],
        total=total,
        lines=[(n, all_lines[n - 1]) for n in picked],
        symbol=header.get("symbol"),
        span=span,  # type: ignore[arg-type]
        grep=grep,
        context=context,
        matches=matches,
        cache_hit=fetched.cache_hit,
        received=fetched.received,
    )


def _compile(grep: str | None) -> re.Pattern[str] | None:
    if grep is None:
        return None
    try:
        return re.compile(grep)
    except re.error as exc:
        raise UsageError(f"--grep {grep!r} is not a valid regular expression: {exc}") from None


def _bounds(lines: LineRange | None, total: int, file: str) -> tuple[int, int]:
    """Clamp a requested range to the file; a start past the end is an error."""
    if lines is None:
        return 1, total
    if lines.start > total:
        raise UsageError(f"--lines {lines.start}: outside {file}, which has {total} lines")
    return lines.start, min(lines.end or total, total)


def _with_context(matches: list[int], context: int, first: int, last: int) -> list[int]:
    """Matching line numbers widened by context lines on each side, sorted and unique."""
    picked: set[int] = set()
    for n in matches:
        picked.update(range(max(first, n - context), min(last, n + context) + 1))
    return sorted(picked)


def read_path(target: Target, dotted: str, cache: SourceCache) -> dict[str, Any]:
    """Remote file path and package version of a module or symbol (no file content moves)."""
    header = fetch_source(target, dotted, cache, content=False).header
    return {
        "host": target.host.name,
        "target": dotted,
        "module": header["module"],
        "file": header["file"],
        "package": header.get("package"),
        "version": header.get("version"),
        "symbol": header.get("symbol"),
        "span": header.get("span"),
    }


# --- live config -------------------------------------------------------------------------------


@dataclass
class ConfigView:
    """Keys of a remote config module, or the one key asked for."""

    host: str
    module: str
    file: str
    version: str
    entries: list[dict[str, Any]]
    key: str | None = None  # set when exactly one key was asked for

    def to_json(self) -> dict[str, Any]:
        """The --json form: the single entry, or the full listing."""
        base = {"host": self.host, "module": self.module, "file": self.file, "version": self.version}
        if self.key is not None:
            return {**base, **self.entries[0]}
        return {**base, "entries": self.entries}


def read_config(target: Target, module: str, key: str = "", grep: str | None = None) -> ConfigView:
    """Live config keys of module in a fresh remote process; key selects one key or a subtree."""
    from .guard import run_guarded

    pattern = _compile(grep)
    argv = [target.host.interpreter, "-c", remote_script("introspect_config"), module]
    # Guarded, unlike the source reads (a file read, stdlib only): it imports torch, seconds and more
    # when cold, and over SSH a Ctrl-C would leave that import running in the container.
    result = run_guarded(target, argv, timeout=CONFIG_TIMEOUT)
    header, _ = _split_reply(target, result.stdout, result)
    if "error" in header:
        raise _config_error(target, module, header)
    keys = [e["key"] for e in header["entries"]]
    if key and not any(k == key or k.startswith(key + ".") for k in keys):
        raise NotFoundError(f"no config key {key} in {module}{suggest(key, keys)}")
    entries, single = select_config(header["entries"], key, pattern)
    return ConfigView(
        host=target.host.name,
        module=module,
        file=header["file"],
        version=header["version"],
        entries=entries,
        key=key if single else None,
    )


def select_config(
    entries: list[dict[str, Any]], key: str, pattern: re.Pattern[str] | None
) -> tuple[list[dict[str, Any]], bool]:
    """Entries for key (exact key, else the subtree under it), then those whose key or env var matches.

    Returns the entries and whether key named exactly one key.
    """
    exact = [e for e in entries if e["key"] == key]
    if exact:
        return exact, True
    if key:
        entries = [e for e in entries if e["key"].startswith(key + ".")]
    if pattern is not None:
        entries = [e for e in entries if pattern.search(e["key"]) or any(pattern.search(v) for v in e["env_vars"])]
    return entries, False


def _config_error(target: Target, module: str, header: dict[str, Any]) -> Exception:
    kind = header["error"]
    if kind == "no_torch":
        return ContainerError(f"{target.label}: torch is not installed for {target.host.interpreter}")
    if kind == "no_module":
        return NotFoundError(f"module not found: {module} ({header.get('message')})")
    return NotFoundError(f"{module} is not a torch config module")


# --- rendering ---------------------------------------------------------------------------------


def plain_source(view: SourceView) -> str:
    """`N: text` lines; with --grep and --context, context lines read `N- text` and gaps `--` (as grep -n)."""
    matched = set(view.matches)
    out, previous = [], None
    for n, text in view.lines:
        if view.grep and view.context and previous is not None and n != previous + 1:
            out.append("--")
        sep = "-" if view.grep and n not in matched else ":"
        out.append(f"{n}{sep} {text}")
        previous = n
    return "".join(line + "\n" for line in out)


def rich_source(view: SourceView) -> Any:
    """One syntax-highlighted panel for a terminal; gaps between runs of lines show as a dim `⋮`."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.syntax import Syntax
    from rich.text import Text

    runs: list[list[tuple[int, str]]] = []
    for n, text in view.lines:
        if runs and n == runs[-1][-1][0] + 1:
            runs[-1].append((n, text))
        else:
            runs.append([(n, text)])
    parts: list[Any] = []
    for run in runs:
        if parts:
            parts.append(Text("⋮", style="dim"))
        code = "\n".join(t for _, t in run)
        parts.append(Syntax(code, "python", line_numbers=True, start_line=run[0][0], highlight_lines=set(view.matches)))
    title = view.file + (f"  {view.symbol} {view.span[0]}-{view.span[1]}" if view.span else "")
    return Panel(Group(*parts), title=title, title_align="left", expand=False)


def plain_config(view: ConfigView) -> str:
    """One value (single key) or `key = value  # default ..., env NAME=...` lines."""
    if view.key is not None:
        return view.entries[0]["repr"] + "\n"
    out = []
    for e in view.entries:
        notes = []
        if e["default_repr"] != e["repr"]:
            notes.append(f"default {e['default_repr']}")
        if e["env_set"]:
            notes.append("env " + ", ".join(f"{k}={v}" for k, v in e["env_set"].items()))
        out.append(f"{e['key']} = {e['repr']}" + (f"  # {'; '.join(notes)}" if notes else ""))
    return "".join(line + "\n" for line in out)


def rich_config(view: ConfigView) -> Any:
    """A table of key, value, default and environment for a terminal (values as Text: no markup)."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"{view.module} on {view.host} (torch {view.version})", title_justify="left")
    for column in ("key", "value", "default", "env"):
        table.add_column(column, overflow="fold")
    for e in view.entries:
        changed = e["default_repr"] != e["repr"]
        env = ", ".join(f"{k}={v}" for k, v in e["env_set"].items()) or ", ".join(e["env_vars"])
        table.add_row(
            Text(e["key"]),
            Text(e["repr"], style="bold yellow" if changed else ""),
            Text(e["default_repr"]),
            Text(env, style="bold" if e["env_set"] else "dim"),
        )
    return table


# --- the command -------------------------------------------------------------------------------


@dataclass(frozen=True)
class InspectOptions:
    """Everything `dflashctl inspect` was asked, already parsed."""

    target: str
    lines: str | None = None
    context: int = 0
    grep: str | None = None
    path: bool = False
    source: bool = False
    json: bool = False


def run_inspect(target: Target, opts: InspectOptions, write: Callable[[str], None], pretty: Any = None) -> None:
    """Do one inspect call; write gets plain text, pretty (a rich Console) gets terminal output."""
    if opts.context < 0:
        raise UsageError("--context must be 0 or more")
    if not opts.target.strip():
        raise UsageError("TARGET is empty: give a module, symbol, alias or config key")
    dotted = expand_alias(opts.target)
    config = config_split(dotted)
    if opts.path:
        info = read_path(target, config[0] if config else dotted, SourceCache(cache_root(), target.host))
        write(json.dumps(info, indent=2) + "\n" if opts.json else _plain_path(info))
        return
    if config and not (opts.source or opts.lines):
        view = read_config(target, config[0], config[1], opts.grep)
        if opts.grep is not None and not view.entries:  # like grep(1): no match is not success
            raise NotFoundError(f"--grep {opts.grep!r}: no key of {view.module} matches")
        if opts.json:
            write(json.dumps(view.to_json(), indent=2) + "\n")
        elif pretty is not None and view.key is None:
            pretty.print(rich_config(view))
        else:
            write(plain_config(view))
        return
    cache = SourceCache(cache_root(), target.host)
    view = read_source(
        target, dotted, cache, lines=parse_lines(opts.lines, opts.context), grep=opts.grep, context=opts.context
    )
    if opts.grep is not None and not view.matches:
        where = f"{view.symbol} in {view.module}" if view.symbol else view.module
        span = f", lines {opts.lines}" if opts.lines else ""
        raise NotFoundError(f"--grep {opts.grep!r}: no match in {where} ({view.file}){span}")
    if opts.json:
        write(json.dumps(view.to_json(), indent=2) + "\n")
    elif pretty is not None:
        pretty.print(rich_source(view))
    else:
        write(plain_source(view))


def _plain_path(info: dict[str, Any]) -> str:
    where = info["file"] + (f":{info['span'][0]}-{info['span'][1]}" if info.get("span") else "")
    return f"{where}\n{info['package']} {info['version'] or '(version unknown)'}\n"
