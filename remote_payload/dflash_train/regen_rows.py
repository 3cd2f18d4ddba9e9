"""What `dflash_train.regen` and its engines share: rows in and out (and reading the prompts
file), options, errors, and the HF tokenizer loader. Standard library only (the openai engine
runs without torch)."""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

KINDS = ("messages", "prompt", "input_ids")
SURVEY_BLOCK = 1 << 20  # bytes the survey reads at once (then to the end of the line)


class RegenError(ValueError):
    """Bad input for the whole run (arguments, files, a missing tokenizer): one line, exit 2."""


class RowError(ValueError):
    """One row cannot be regenerated (malformed, too long, a template error): it goes to the
    errors file with this reason and the run goes on."""


class EngineError(RuntimeError):
    """The engine cannot go on (an endpoint down after every retry): exit 1, resumable."""


@dataclass
class Row:
    """One input row: its index and its parsed object, or why it could not be parsed."""

    index: int
    data: dict | None
    error: str | None = None


@dataclass
class Done:
    """One row's result: the output row, or the reason it failed; new tokens generated."""

    index: int
    row: dict | None = None
    error: str | None = None
    new_tokens: int = 0


@dataclass
class Options:
    """What every engine needs to know about the generation."""

    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    thinking: bool | None = None  # None: the chat template's default
    batch_size: int | None = 1  # rows per batch (builtin: pads each batch's generation to it; None: auto_batch)
    stop: threading.Event = field(default_factory=threading.Event)


# --- rows ---------------------------------------------------------------------------------------


def row_kind(row: dict) -> str:
    """messages | prompt | input_ids: the first of those keys the row has (RowError: none)."""
    for kind in KINDS:
        if kind in row:
            return kind
    raise RowError("row has none of messages, prompt, input_ids")


def conversation(messages: Any) -> list[dict]:
    """The messages up to and including the last user turn (RowError when there is none)."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise RowError("messages must be a list of objects")
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    if not users:
        raise RowError("messages has no user turn to answer")
    return messages[: users[-1] + 1]


def token_ids(value: Any, vocab_size: int | None = None) -> list[int]:
    """A row's input_ids as a non-empty list of token ids (RowError otherwise)."""
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
    ):
        raise RowError("input_ids must be a non-empty list of token ids")
    if vocab_size is not None and max(value) >= vocab_size:
        raise RowError(f"token id {max(value)} is outside the target's vocabulary ({vocab_size})")
    return value


def encode_prompt(tok, kind: str, data: dict, thinking: bool | None) -> tuple[list[int], list[dict] | None]:
    """(the token ids to continue, the conversation for a chat row) of a `prompt` or `messages`
    row with tokenizer `tok`; a chat gets the template's generation prompt (RowError: cannot)."""
    if kind == "prompt":
        if not isinstance(data["prompt"], str) or not data["prompt"]:
            raise RowError("prompt must be a non-empty string")
        return list(tok(data["prompt"])["input_ids"]), None
    convo = conversation(data["messages"])
    extra = {} if thinking is None else {"enable_thinking": thinking}
    try:
        text = tok.apply_chat_template(convo, tokenize=False, add_generation_prompt=True, **extra)
    except Exception as exc:  # noqa: BLE001 - jinja raises many types; each is this row's error
        raise RowError(f"chat template: {type(exc).__name__}: {exc}") from None
    return list(tok(text, add_special_tokens=False)["input_ids"]), convo


def token_row(index: int, prompt: list[int], new: list[int], finish: str) -> dict:
    """The trainer's token row: prompt + response, only the response supervised."""
    return {
        "index": index,
        "input_ids": prompt + new,
        "loss_mask": [0] * len(prompt) + [1] * len(new),
        "finish_reason": finish,
    }


def chat_row(
    index: int,
    convo: list[dict],
    reply: str,
    finish: str,
    reply_ids: list[int] | None = None,
    thinking: bool | None = None,
) -> dict:
    """The trainer's chat row: the conversation and the target's reply; with `reply_ids` (the
    tokens the target emitted for it, its end-of-turn token included) and the `enable_thinking`
    its prompt was rendered with, so the trainer supervises exactly those tokens."""
    row = {"index": index, "messages": convo + [{"role": "assistant", "content": reply}]}
    if reply_ids is not None:
        row["reply_ids"] = reply_ids
        if thinking is not None:
            row["chat_template_kwargs"] = {"enable_thinking": thinking}
    row["finish_reason"] = finish
    return row


# --- reading the input ---------------------------------------------------------------------------


@dataclass
class Survey:
    """The prompts file read once before the run: its rows and the line of each kind's first row."""

    rows: int = 0
    first: dict[str, int] = field(default_factory=dict)  # kind -> line number (from 1)


def survey_rows(path: Path) -> Survey:
    """Count the rows (non-blank lines, streamed) and note where each kind first appears; a row
    that is not a JSON object or has no kind is left to fail on its own in the run. Only a row
    that may be of a kind not seen yet is parsed, so a file of one kind is parsed at its first row."""
    survey = Survey()
    unseen = [f'"{k}"'.encode() for k in KINDS]
    number = 0
    with path.open("rb") as fh:
        while block := fh.read(SURVEY_BLOCK):
            block += fh.readline()  # whole lines; the file's last may have no newline
            lines = block.split(b"\n")
            if block.endswith(b"\n"):
                lines.pop()
            if not (unseen and _may_name(block, unseen)):  # one search answers for the block's rows
                survey.rows += sum(1 for line in lines if line.strip())
                number += len(lines)
                continue
            for line in lines:
                number += 1
                if not line.strip():
                    continue
                survey.rows += 1
                if unseen and _may_name(line, unseen):
                    row = parse_row(0, line).data
                    kind = next((k for k in KINDS if k in row), None) if row is not None else None
                    if kind is not None and kind not in survey.first:
                        survey.first[kind] = number
                        unseen.remove(f'"{kind}"'.encode())
    return survey


# A key's ASCII letter or underscore written as an escape (\u0040-\u007f): `"\u006dessages"` is messages.
_ASCII_ESCAPE = re.compile(rb"\\u00[4-7]")


def _may_name(text: bytes, keys: list[bytes]) -> bool:
    """Whether JSON lines may have one of these quoted keys: they hold one as written, spell one
    with escapes, or are UTF-16/32 (json reads those; their NUL bytes are invalid in UTF-8 JSON)."""
    return any(key in text for key in keys) or b"\x00" in text or _ASCII_ESCAPE.search(text) is not None


def read_batches(path: Path, batch_size: int, first_batch: int) -> Iterator[tuple[int, list[Row]]]:
    """(batch number, its rows) from batch `first_batch` on; batch j holds rows j*B..j*B+B-1."""
    skip = first_batch * batch_size
    index, rows = 0, []
    with path.open("rb") as fh:
        for line in fh:
            if not line.strip():
                continue
            if index >= skip:
                rows.append(parse_row(index, line))
                if len(rows) == batch_size:
                    yield index // batch_size, rows
                    rows = []
            index += 1
    if rows:
        yield rows[0].index // batch_size, rows


def parse_row(index: int, line: bytes) -> Row:
    """One line as a Row (a parse failure is the row's error, not the run's)."""
    try:
        data = json.loads(line)
    except ValueError as exc:
        return Row(index, None, f"not JSON ({exc})")
    if not isinstance(data, dict):
        return Row(index, None, "not a JSON object")
    return Row(index, data)


def load_tokenizer(path: str):
    """The HF tokenizer in a local directory (never fetched from a hub: a container must not)."""
    if not Path(path, "tokenizer_config.json").is_file():
        raise RegenError(f"{path} is not a tokenizer directory (no tokenizer_config.json)")
    from transformers import AutoTokenizer  # an ImportError here is the run's exit 4

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


class SharedTokenizer:
    """One tokenizer for every worker thread, loaded on first use; `with shared as tok:` holds it
    (fast tokenizers are not reentrant: two threads encoding at once can fail)."""

    def __init__(self, path: str | None, missing: str):
        self.path, self.missing = path, missing
        self._tok = None
        self._lock = threading.RLock()

    def __enter__(self):
        self._lock.acquire()
        try:
            if self._tok is None:
                if self.path is None:
                    raise RegenError(self.missing)
                self._tok = load_tokenizer(self.path)
        except BaseException:
            self._lock.release()
            raise
        return self._tok

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
