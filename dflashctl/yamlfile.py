"""YAML that users write (hosts.yaml, `train --config`), read strictly: bad UTF-8, bad syntax, a key
given twice or a value that cannot be built is one UsageError naming the file, line and column."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from .errors import UsageError

_MERGE_TAG = "tag:yaml.org,2002:merge"  # `<<: *base` may repeat keys of the base: that is its purpose


def _strict(base: type) -> type:
    """`base` (a safe loader) whose values that its constructors refuse with a plain exception
    (`2024-13-45`, `!!int x`) become YAML errors marked with where the value is."""

    def construct_object(self: Any, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return base.construct_object(self, node, deep)
        except (ValueError, TypeError, AttributeError) as exc:
            raise yaml.constructor.ConstructorError(None, None, f"bad value: {exc}", node.start_mark) from None

    return type("Strict" + base.__name__, (base,), {"construct_object": construct_object})


_LOADER = _strict(yaml.SafeLoader)
# libyaml where PyYAML has it: 5x faster on every call's hosts.yaml; its errors are re-read in Python, whose say more
_FAST_LOADER = _strict(yaml.CSafeLoader) if hasattr(yaml, "CSafeLoader") else None


def load_yaml_file(path: Path, label: str) -> Any:
    """The YAML file at `path`, parsed strictly; errors start with `label` (`--config: PATH`)."""
    if path.is_dir():
        raise UsageError(f"{label} is a directory, not a file")
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise UsageError(f"{label}: no such file") from None
    except OSError as exc:
        raise UsageError(f"{label}: cannot read: {exc.strerror}") from None
    return load_yaml(data, label)


def load_yaml(data: str | bytes, label: str) -> Any:
    """YAML text (bytes: UTF-8) parsed strictly; UsageError `LABEL: line L, column C: PROBLEM`."""
    text = _decode(data, label) if isinstance(data, bytes) else data
    if _FAST_LOADER is not None:
        try:
            return _load(text, _FAST_LOADER, label)
        except yaml.YAMLError:
            pass
    try:
        return _load(text, _LOADER, label)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" line {mark.line + 1}, column {mark.column + 1}:" if mark else ""
        raise UsageError(f"{label}:{where} {exc.problem or exc.context or 'invalid YAML'}") from None
    except yaml.reader.ReaderError as exc:  # a control character: its position is in characters
        line, column = _line_column(text, exc.position)
        raise UsageError(f"{label}: line {line}, column {column}: {str(exc).splitlines()[0]}") from None
    except yaml.YAMLError as exc:
        raise UsageError(f"{label}: {str(exc).splitlines()[0]}") from None


def _line_column(text: str | bytes, offset: int) -> tuple[int, int]:
    newline = "\n" if isinstance(text, str) else b"\n"
    return text.count(newline, 0, offset) + 1, offset - text.rfind(newline, 0, offset)  # type: ignore[arg-type]


def _decode(data: bytes, label: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line, column = _line_column(data, exc.start)
        bad = data[exc.start]
        raise UsageError(f"{label}: line {line}, column {column}: not UTF-8 text (byte 0x{bad:02x})") from None


def _load(text: str, loader_class: type, label: str) -> Any:
    loader = loader_class(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _refuse_duplicate_keys(node, label)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _refuse_duplicate_keys(root: yaml.Node, label: str) -> None:
    """UsageError naming the first key that a mapping gives twice (PyYAML keeps the last, silently)."""
    todo: list[tuple[yaml.Node, str]] = [(root, "")]
    seen: set[int] = set()  # an anchored node is walked once, however often it is aliased
    found: list[tuple[int, str]] = []
    while todo:
        node, where = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            todo += [(item, f"{where}[{i}]") for i, item in enumerate(node.value)]
        if not isinstance(node, yaml.MappingNode):
            continue
        first: dict[tuple[str, str], int] = {}
        for key, value in node.value:
            if not isinstance(key, yaml.ScalarNode) or key.tag == _MERGE_TAG:
                continue
            line, ident = key.start_mark.line + 1, (key.tag, key.value)  # scalars compared as written
            if ident in first:
                inside = f"in {where}" if where else "at top level"
                found.append((line, f"duplicate key '{key.value}' {inside} (first on line {first[ident]})"))
            first.setdefault(ident, line)
            todo.append((value, f"{where}.{key.value}" if where else key.value))
    if found:
        line, problem = min(found)
        raise UsageError(f"{label}: line {line}: {problem}")
