"""Remote side of `dflashctl inspect inductor.config`: every live key of a torch config module.

Runs as `python -c <this file> MODULE` inside the container. This is the one inspect form that
imports torch, because the values only exist in a live process (they depend on the environment
and on torch's own import-time logic).

For each key of `module._config` (torch.utils._config_module: nested classes are flattened to
`triton.cudagraph_trees`) it reports the current value, the default that applies when no
environment variable is set, and which environment variables the key reads and which of them are
set. Keys declared with `Config(env_name_force=..., env_name_default=...)` name their variables;
plain assignments like `x = os.environ.get("TORCHINDUCTOR_X") == "1"` are found by reading the
assignment (and the module-level helper functions it calls) with `ast`.
"""

import json
import os
import sys

MARKER = "@@dflashctl-inspect@@ "
ENV_NAME = r"^[A-Z][A-Z0-9_]*_[A-Z0-9_]+$"


def main():
    """Print the marker and the JSON answer for the config module named by argv[1]."""
    print(MARKER + json.dumps(answer(sys.argv[1]), default=repr))


def answer(name):
    """Header plus one entry per config key, or an error dict."""
    import importlib
    import warnings

    try:
        import torch
    except ImportError as exc:
        return {"error": "no_torch", "message": str(exc)}
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        return {"error": "no_module", "module": name, "message": str(exc)}
    if not isinstance(getattr(module, "_config", None), dict):
        return {"error": "not_config", "module": name}
    env_names = env_names_by_key(module.__file__)
    defaults = pristine_defaults(module, env_names)
    entries = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated keys warn on every read
        for key in sorted(module._config):
            entry = module._config[key]
            if entry.hide:
                continue
            names = env_names.get(key, [])
            value = getattr(module, key)
            entries.append(
                {
                    "key": key,
                    "value": plain(value),
                    "repr": repr(value),
                    "default": plain(defaults.get(key, entry.default)),
                    "default_repr": repr(defaults.get(key, entry.default)),
                    "env_vars": names,
                    "env_set": {n: os.environ[n] for n in names if n in os.environ},
                    "alias": entry.alias,
                }
            )
    version = torch.__version__
    return {"module": name, "file": module.__file__, "package": "torch", "version": str(version), "entries": entries}


def plain(value):
    """A JSON-able form of a config value; anything exotic becomes its repr."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((plain(v) for v in value), key=repr)
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: plain(v) for k, v in value.items()}
    return repr(value)


def env_names_by_key(path):
    """{flattened key: environment variable names its assignment reads}, from the module's source."""
    import ast

    with open(path, "rb") as handle:
        tree = ast.parse(handle.read())
    helpers = {
        node.name: strings_in(node) for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    found = {}
    collect_assignments(tree.body, "", helpers, found)
    return found


def collect_assignments(statements, prefix, helpers, found):
    """Walk module and nested config classes, mapping each assigned key to the env names it reads."""
    import ast

    for node in statements:
        if isinstance(node, ast.ClassDef):
            collect_assignments(node.body, f"{prefix}{node.name}.", helpers, found)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = strings_in(node.value)
            for call in ast.walk(node.value):
                if isinstance(call, ast.Call) and isinstance(call.func, ast.Name):
                    names += helpers.get(call.func.id, [])
            for target in targets:
                if isinstance(target, ast.Name) and names:
                    found[prefix + target.id] = sorted(set(names))
        elif isinstance(node, (ast.If, ast.Try)):
            for field in ("body", "orelse", "finalbody"):
                collect_assignments(getattr(node, field, []), prefix, helpers, found)


def strings_in(node):
    """String constants under node that look like environment variable names."""
    import ast
    import re

    return [
        n.value
        for n in ast.walk(node)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and re.match(ENV_NAME, n.value)
    ]


def pristine_defaults(module, env_names):
    """Defaults as they would be with none of the module's env vars set.

    Plain keys bake the environment into `_config[key].default` at import, so when any of those
    variables is set we execute the module's source once more, into a scratch module object and
    with those variables removed, and read its defaults.
    """
    import types

    set_names = {n for names in env_names.values() for n in names if n in os.environ}
    if not set_names:
        return {}
    saved = {n: os.environ.pop(n) for n in set_names}
    scratch = types.ModuleType(module.__name__)
    scratch.__file__, scratch.__package__ = module.__file__, module.__package__
    real = sys.modules[module.__name__]
    # The module ends with install_config_module(sys.modules[__name__]): point that at the scratch copy.
    sys.modules[module.__name__] = scratch
    try:
        with open(module.__file__, "rb") as handle:
            exec(compile(handle.read(), module.__file__, "exec"), scratch.__dict__)
        return {key: entry.default for key, entry in scratch._config.items()}
    finally:
        sys.modules[module.__name__] = real
        os.environ.update(saved)


if __name__ == "__main__":
    main()
