"""regen's survey of the prompts file (regen_rows.survey_rows): the rows and where each kind first
appears, as parsing every row would find them, parsing only the rows that may be of a kind not
seen yet (it was run twice per regen, pre-flight and run, and parsed a one-kind file whole)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_train import regen_rows
from dflash_train.regen_rows import KINDS, survey_rows


def survey_by_parsing_every_row(path: Path) -> tuple[int, dict[str, int]]:
    """(rows, kind -> first line) with every non-blank line parsed: what the survey must equal."""
    rows, first = 0, {}
    with path.open("rb") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            rows += 1
            try:
                data = json.loads(line)
            except ValueError:
                continue
            kind = next((k for k in KINDS if k in data), None) if isinstance(data, dict) else None
            if kind is not None:
                first.setdefault(kind, number)
    return rows, first


def counting_parses(monkeypatch) -> list[int]:
    """A list that grows by one for each row the survey parses (regen_rows.parse_row, unchanged)."""
    calls: list[int] = []
    parse = regen_rows.parse_row

    def counted(index: int, line: bytes) -> regen_rows.Row:
        calls.append(index)
        return parse(index, line)

    monkeypatch.setattr(regen_rows, "parse_row", counted)
    return calls


def test_a_file_of_one_kind_is_parsed_at_its_first_row(tmp_path, monkeypatch):
    path = tmp_path / "p.jsonl"
    # A value that says prompt or messages in prose, and non-ASCII escapes, are not keys.
    path.write_text(
        "".join(
            json.dumps({"input_ids": [i, 1, 2], "note": f"the prompt's messages, caf\u00e9 \u65e5 {i}"}) + "\n"
            for i in range(200)
        )
    )
    parses = counting_parses(monkeypatch)
    survey = survey_rows(path)
    assert (survey.rows, survey.first) == (200, {"input_ids": 1}) == survey_by_parsing_every_row(path)
    assert len(parses) == 1


@pytest.mark.parametrize(
    "later, kind",
    [
        ('{"prompt": "hi"}', "prompt"),
        ('{"input_ids": [1], "messages": [{"role": "user", "content": "x"}]}', "messages"),  # messages wins
        ('{"\\u0070rompt": "an escaped key"}', "prompt"),
        ('{"\\u006Dessages": [], "x": 1}', "messages"),
        (json.dumps({"prompt": "utf-16"}).encode("utf-16"), "prompt"),  # json.loads reads UTF-16 bytes
        ('{"meta": {"prompt": "nested"}, "input_ids": [3]}', None),  # a nested key is no kind
        ('["prompt", "messages"]', None),  # not an object
        ('{"prompt": ', None),  # not JSON
        ('{"note": "prompt"}', None),  # a value, quoted as a key would be
    ],
)
def test_the_survey_finds_what_parsing_every_row_finds(tmp_path, monkeypatch, later, kind):
    rows = [json.dumps({"input_ids": [i]}).encode() for i in range(5)] + [b"   "]
    # Last and without a newline: a UTF-16 line is whole only there (its `\n` is two bytes).
    rows += [later if isinstance(later, bytes) else later.encode()]
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\n".join(rows))
    parses = counting_parses(monkeypatch)
    survey = survey_rows(path)
    assert (survey.rows, survey.first) == survey_by_parsing_every_row(path)
    assert survey.first == {"input_ids": 1, **({kind: 7} if kind else {})}
    # The first row and, of the rest, at most the one that may be another kind.
    assert len(parses) <= 2


@pytest.mark.parametrize("block", [1, 9, 100, regen_rows.SURVEY_BLOCK])
def test_the_survey_is_the_same_whatever_its_block_size(tmp_path, monkeypatch, block):
    """Blocks end at a line's end: blank and whitespace lines, CRLF and a last line without a newline."""
    lines = [b'{"input_ids": [1]}', b"", b"  \t", b'{"input_ids": [2]}\r', b"not json", b'{"x": 1}']
    lines += [b'{"input_ids": [3]}'] * 20 + [b'{"prompt": "a"}\r', b"", b'{"input_ids": [4]}'] * 3
    lines += [b'{"messages": [{"role": "user", "content": "b"}]}']
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\n".join(lines))
    monkeypatch.setattr(regen_rows, "SURVEY_BLOCK", block)
    survey = survey_rows(path)
    assert (
        (survey.rows, survey.first)
        == survey_by_parsing_every_row(path)
        == (31, {"input_ids": 1, "prompt": 27, "messages": 36})
    )
