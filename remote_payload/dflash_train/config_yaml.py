"""The run config file (`--config FILE`) read strictly: PyYAML keeps the last of a key given twice
and fails on bad UTF-8 with a message naming neither line nor key; here both are a ConfigError."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

MERGE_TAG = "tag:yaml.org,2002:merge"  # `<<: *base` exists to be overridden by the keys after it


class DuplicateKey(yaml.MarkedYAMLError):
    """A mapping that gives one key twice."""


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a mapping's repeated key (every mapping is built through here)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        """The mapping, after checking its own keys as written (before merges are flattened in)."""
        first: dict[tuple[str, str], int] = {}
        for key, _ in node.value:
            if not isinstance(key, yaml.ScalarNode) or key.tag == MERGE_TAG:
                continue
            line = key.start_mark.line + 1
            seen = first.setdefault((key.tag, key.value), line)
            if seen != line:
                raise DuplicateKey(
                    problem=f"duplicate key '{key.value}' (first on line {seen})", problem_mark=key.start_mark
                )
        return super().construct_mapping(node, deep)


def read_yaml(path: str, error: type[Exception]) -> Any:
    """The YAML file at `path`; `error("config PATH: line L: PROBLEM")` when it cannot be read."""
    label = f"config {path}"
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise error(f"cannot read {label}: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - data.rfind(b"\n", 0, exc.start)
        raise error(f"{label}: line {line}, column {column}: not UTF-8 text (byte 0x{data[exc.start]:02x})") from None
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" line {mark.line + 1}, column {mark.column + 1}:" if mark else ""
        raise error(f"{label}:{where} {exc.problem or exc.context or 'invalid YAML'}") from None
    except yaml.YAMLError as exc:
        raise error(f"{label}: {str(exc).splitlines()[0]}") from None
