"""Remote side of `dflashctl inspect` for source: find a module's file without importing it.

Runs as `python -c <this file> REQUEST_JSON` inside the container with nothing but the standard
library. It must stay cheap: no torch import (importing torch costs seconds), and `find_spec` is
only ever called on the top-level package, because `find_spec('a.b')` imports package `a`.

Prints one line `MARKER {header json}` and then, unless the client already holds a copy with the
same SHA-256 or asked for none, the file's raw bytes.
"""

import hashlib
import json
import os
import re
import sys

MARKER = b"@@dflashctl-inspect@@ "


def main():
    """Answer the JSON request in argv[1] on stdout: marker and header line, then the content sent."""
    request = json.loads(sys.argv[1])
    try:
        header, content = answer(request)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError) as exc:
        header, content = {"error": "unreadable", "message": f"{type(exc).__name__}: {exc}"}, b""
    out = sys.stdout.buffer
    out.write(MARKER + json.dumps(header).encode() + b"\n")
    out.write(content)
    out.flush()


def answer(request):
    """The header dict and the bytes to send for one request."""
    parts = request["target"].split(".")
    found = resolve(parts)
    if "error" in found:
        return found, b""
    header = {
        "module": found["module"],
        "file": found["file"],
        "is_package": found["is_package"],
        **package_version(parts[0], found["root"], found["file"]),
    }
    with open(found["file"], "rb") as handle:
        data = handle.read()
    digest = hashlib.sha256(data).hexdigest()
    header["sha256"] = digest
    rest = found["rest"]
    if rest:
        located = locate_symbol(data, rest)
        if "error" in located:
            located.update(module=found["module"], file=found["file"], is_package=found["is_package"])
            if found["is_package"]:
                located["children"] = found["children"]
            return located, b""
        header.update(located)
    send = request.get("content", True) and request.get("have", {}).get(found["module"]) != digest
    header["sent"] = len(data) if send else 0
    return header, data if send else b""


def find_top(name):
    """find_spec of a top-level package, also under `python -S`.

    The client starts this script with -S (no site set-up: ~50 ms less per read), so the
    site-packages directories are added by hand, in site's order, without running their .pth
    files; only when that finds nothing does the full site set-up run.
    """
    import importlib.util

    if sys.flags.no_site:
        for path in site_dirs():
            if path not in sys.path and os.path.isdir(path):
                sys.path.append(path)
        spec = importlib.util.find_spec(name)
        if spec is not None:
            return spec
        import site

        site.main()
    return importlib.util.find_spec(name)


def site_dirs():
    """The site-packages directories site.py would add, in its order, without running it.

    Under -S a venv's interpreter still has the base installation's prefix (site.py is what
    reads pyvenv.cfg), so the venv's own directories are found here the way site.venv() does:
    first, and alone (no user site, no base) unless include-system-site-packages is true.
    """
    import site

    exe_dir = os.path.dirname(os.path.abspath(sys.executable))
    venv_prefix = os.path.dirname(exe_dir)
    configs = [os.path.join(d, "pyvenv.cfg") for d in (exe_dir, venv_prefix)]
    config = next((c for c in configs if os.path.isfile(c)), None)
    system = True
    dirs = []
    if config is not None:
        with open(config, encoding="utf-8") as f:
            for line in f:
                key, sep, value = line.partition("=")
                if sep and key.strip().lower() == "include-system-site-packages":
                    system = value.strip().lower() == "true"
        dirs = site.getsitepackages([venv_prefix])
    if system:
        if site.check_enableusersite():
            dirs.append(site.getusersitepackages())
        dirs += site.getsitepackages()
    return dirs


def resolve(parts):
    """Walk dotted parts down the file system; the longest module prefix wins, the rest is a symbol."""
    spec = find_top(parts[0])
    if spec is None:
        return {"error": "no_module", "module": parts[0], "rest": parts[1:], "children": []}
    dirs = list(spec.submodule_search_locations or [])
    # The directory that holds the top-level package: where its dist-info lives.
    root = os.path.dirname(dirs[0] if dirs else (spec.origin or ""))
    module, path = parts[0], spec.origin if spec.has_location else None
    index = 1
    while index < len(parts) and dirs:
        child = find_child(dirs, parts[index])
        if child is None:
            break
        path, dirs = child
        module += "." + parts[index]
        index += 1
    rest = parts[index:]
    children = list_children(dirs) if rest else []
    if path is None or not path.endswith(".py") or not os.path.isfile(path):
        builtin = index == 1 and spec.origin in ("built-in", "frozen")
        return {
            "error": "no_source",
            "module": module,
            "file": path,
            "builtin": builtin,
            "rest": rest,
            "children": children,
        }
    return {"module": module, "file": path, "root": root, "is_package": bool(dirs), "rest": rest, "children": children}


def find_child(dirs, name):
    """(file or None, package dirs) of submodule `name`, in the order importlib's FileFinder checks."""
    from importlib.machinery import all_suffixes

    portions = []
    for base in dirs:
        candidate = os.path.join(base, name)
        if os.path.isdir(candidate):
            for suffix in all_suffixes():
                init = os.path.join(candidate, "__init__" + suffix)
                if os.path.isfile(init):
                    return init, [candidate]
            portions.append(candidate)
        for suffix in all_suffixes():
            if os.path.isfile(candidate + suffix):
                return candidate + suffix, []
    # A directory without __init__ anywhere on the path is a namespace package.
    return (None, portions) if portions else None


def list_children(dirs):
    """Importable names directly inside a package's directories, for 'did you mean' hints."""
    from importlib.machinery import all_suffixes

    names = set()
    for base in dirs:
        try:
            entries = os.listdir(base)
        except OSError:
            continue
        for entry in entries:
            stem = entry.split(".", 1)[0]
            is_module = any(entry.endswith(s) for s in all_suffixes())
            if (
                stem.isidentifier()
                and stem not in ("__init__", "__pycache__")
                and (is_module or os.path.isdir(os.path.join(base, entry)))
            ):
                names.add(stem)
    return sorted(names)


def package_version(top, root, file):
    """Distribution name and version of the top-level package, read from files, never by import."""
    version_py = os.path.join(root, top, "version.py")
    match = re.search(r"""^__version__\s*=\s*['"]([^'"]+)['"]""", read_text(version_py), re.M)
    if match:
        return {"package": top, "version": match.group(1)}
    version = dist_info_version(root, top)
    if version:
        return {"package": top, "version": version}
    stdlib = os.path.dirname(os.__file__)
    if file.startswith(stdlib + os.sep) and "-packages" not in file:
        return {"package": "python", "version": sys.version.split()[0]}
    return {"package": top, "version": None}


def dist_info_version(root, top):
    """`Version:` of the dist-info next to the package named like it or listing it in top_level.txt."""
    try:
        infos = [e for e in os.listdir(root) if e.endswith(".dist-info")]
    except OSError:
        return None
    wanted = re.sub(r"[-_.]+", "_", top).lower()
    named = [e for e in infos if re.sub(r"[-_.]+", "_", e.split("-")[0]).lower() == wanted]
    # Import name and distribution name can differ (yaml comes from PyYAML).
    for entry in named or [e for e in infos if top in read_text(os.path.join(root, e, "top_level.txt")).split()]:
        for line in read_text(os.path.join(root, entry, "METADATA")).splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    return None


def read_text(path):
    """A small metadata file's text, or '' when it is missing."""
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read()
    except OSError:
        return ""


def source_lines(data):
    """The file's lines exactly as linecache holds them (what inspect.getsource joins)."""
    import io
    import tokenize

    encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    lines = io.TextIOWrapper(io.BytesIO(data), encoding, line_buffering=True).readlines()
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    return lines


def locate_symbol(data, path):
    """Span of a (nested) definition, numbered like `inspect.getsource(module).splitlines()`."""
    import ast
    import inspect

    lines = source_lines(data)
    scope = ast.parse("".join(lines))
    for depth, name in enumerate(path):
        node = find_definition(scope, name)
        if node is None:
            names = sorted({found for found, _ in definitions(scope)})
            return {"error": "no_symbol", "symbol": ".".join(path[: depth + 1]), "candidates": names}
        scope = node
    start = min([scope.lineno] + [d.lineno for d in getattr(scope, "decorator_list", [])])
    if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        # inspect's own block finder, so the end matches getsource (trailing comments and all).
        end = start + len(inspect.getblock(lines[start - 1 :])) - 1
    else:
        end = scope.end_lineno
    # splitlines() also breaks on \f, \x1c, \u2028 ...: shift into that numbering.
    first = 1 + sum(len(line.splitlines()) for line in lines[: start - 1])
    count = sum(len(line.splitlines()) for line in lines[start - 1 : end])
    return {"symbol": ".".join(path), "kind": type(scope).__name__, "span": [first, first + count - 1]}


def definitions(scope):
    """(name, node) for every def, class and assignment directly in scope (through if/try/with)."""
    return _bindings(scope.body)


def _bindings(statements):
    import ast

    for node in statements:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name, node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    yield target.id, node
        else:
            # Conditional definitions (if/try/with at this level) still bind names in this scope.
            for field in ("body", "orelse", "handlers", "finalbody"):
                yield from _bindings(getattr(node, field, []))


def find_definition(scope, name):
    """The first definition of name in scope, in source order."""
    for found, node in definitions(scope):
        if found == name:
            return node
    return None


if __name__ == "__main__":
    main()
