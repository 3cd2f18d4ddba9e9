"""Regenerated chat rows train on exactly the tokens the target emitted (issue 28, item 2): the
builtin engine keeps the reply's token ids beside the messages, and the trainer's data path
supervises those ids after the prompt as regen rendered it, where re-encoding the reply's text
with a byte-level BPE gives other tokens."""

from __future__ import annotations

import json

import pytest
import torch
from test_data import CHATS, save_tokenizer
from test_regen import THINK_TEMPLATE, read_jsonl, write_rows

from dflash_train import regen
from dflash_train.config import TargetConfig
from dflash_train.data import DataError, load_jsonl, tokenize_chat
from dflash_train.target import build_tiny_target

NEW = 12


def target_greedy(prompt: list[int], vocab: int, mask: int, eos: int) -> list[int]:
    """The tiny target's greedy reply, one full forward per token (independent of regen's decode
    path): up to NEW tokens, ending with the end-of-turn token when it emits one."""
    target = build_tiny_target(TargetConfig(vocab_size=vocab), 0)
    new: list[int] = []
    while len(new) < NEW and (not new or new[-1] != eos):
        logits = target.logits(torch.tensor([prompt + new]))[0, -1]
        logits[mask] = float("-inf")
        new.append(int(logits.argmax()))
    return new


def merge_pair(path, pair: tuple[str, str], avoid: set[int]):
    """Rewrite the BPE at `path` so the tokens `pair` merge into one, and load it: a learned merge
    that no text of the test uses (its id not in `avoid`, not part of another merge) gives its id
    up, so the vocabulary keeps its size and every prompt its tokens."""
    from transformers import AutoTokenizer

    spec = json.loads((path / "tokenizer.json").read_text())
    model = spec["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    parts = {p for m in merges for p in m}
    slot = next(m for m in merges if "".join(m) not in parts and model["vocab"]["".join(m)] not in avoid)
    merges.remove(slot)
    model["vocab"]["".join(pair)] = model["vocab"].pop("".join(slot))
    model["merges"] = [list(m) for m in merges + [pair]]
    (path / "tokenizer.json").write_text(json.dumps(spec))
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


@pytest.mark.parametrize("thinking", [None, False])
def test_regenerated_chat_rows_train_on_the_targets_own_reply_tokens(tmp_path, thinking):
    tok = save_tokenizer(tmp_path / "tok", chat_template=THINK_TEMPLATE)
    vocab, mask_id, eos = len(tok), tok.convert_tokens_to_ids("<|MASK|>"), tok.eos_token_id
    convos = [CHATS[0][:4], CHATS[1][:1]] + [
        [{"role": "user", "content": f"Where did the {w} sit?"}] for w in ("cat", "dog", "frog", "hat")
    ]
    extra = {} if thinking is None else {"enable_thinking": thinking}

    def render(tok) -> list[list[int]]:
        return [
            tok(
                tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True, **extra),
                add_special_tokens=False,
            )["input_ids"]
            for c in convos
        ]

    prompts = render(tok)
    emitted = [target_greedy(p, vocab, mask_id, eos) for p in prompts]
    # A tokenizer where merges make decode -> encode differ from what the target emitted: two
    # word pieces it emitted side by side become one token (the prompts keep their tokens, so
    # the target emits the same).
    pair = next(
        (a, b) for new in emitted for a, b in zip(new, new[1:]) if all(tok.decode([t]).isalpha() for t in (a, b))
    )
    tok = merge_pair(
        tmp_path / "tok", tuple(tok.convert_ids_to_tokens(list(pair))), {t for ids in prompts + emitted for t in ids}
    )
    assert render(tok) == prompts and len(tok) == vocab

    src = write_rows(tmp_path / "chats.jsonl", [{"messages": c} for c in convos])
    out = tmp_path / "regen.jsonl"
    flag = [] if thinking is None else ["--thinking", "off"]
    assert (
        regen.main(
            [
                "--prompts",
                str(src),
                "--out",
                str(out),
                "--set",
                f"target.vocab_size={vocab}",
                "--tokenizer",
                str(tmp_path / "tok"),
                "--max-new-tokens",
                str(NEW),
                "--batch-size",
                "3",
                *flag,
            ]
        )
        == 0
    )
    rows = read_jsonl(out)
    # The precondition that makes this test mean something: re-encoding the replies' text (what
    # the trainer did with these rows before) gives tokens the target did not emit, through the
    # merge in a reply of whole characters, and through bytes that are not whole UTF-8
    # characters (decoded to U+FFFD) in others.
    renders = [tokenize_chat(r["messages"], tok) for r in rows]
    differ = [
        r["messages"][-1]["content"] for r, (ids, m), new in zip(rows, renders, emitted) if ids[m].tolist() != new
    ]
    assert len(differ) >= 2 and any("\ufffd" not in text for text in differ), differ

    seqs = load_jsonl(out, str(tmp_path / "tok"))
    for row, prompt, new, (ids, mask) in zip(rows, prompts, emitted, seqs):
        assert row["reply_ids"] == new and row["finish_reason"] == ("stop" if new[-1] == eos else "length")
        assert row.get("chat_template_kwargs") == (None if thinking is None else {"enable_thinking": False})
        assert row["messages"][-1]["content"] == tok.decode(new, skip_special_tokens=True)
        assert ids.tolist() == prompt + new  # the prompt the target saw, then what it emitted
        assert mask.tolist() == [False] * len(prompt) + [True] * len(new)


def test_non_canonical_reply_ids_train_as_given_and_ids_that_do_not_match_the_row_are_errors(tmp_path):
    tok = save_tokenizer(tmp_path / "tok")
    convo = [{"role": "user", "content": "Say hello."}]
    # A reply emitted one character at a time: valid text whose merges re-encode it otherwise.
    ids = [t for c in "Hello there" for t in tok(c, add_special_tokens=False)["input_ids"]] + [tok.eos_token_id]
    assert tok("Hello there", add_special_tokens=False)["input_ids"] + [tok.eos_token_id] != ids
    good = {"messages": convo + [{"role": "assistant", "content": "Hello there"}], "reply_ids": ids}
    ((seq, mask),) = load_jsonl(write_rows(tmp_path / "ok.jsonl", [good]), str(tmp_path / "tok"))
    assert seq[mask].tolist() == ids and not mask[: -len(ids)].any()
    cases = {
        "edited": (
            {**good, "messages": convo + [{"role": "assistant", "content": "Hello you"}]},
            "reply_ids do not decode to the assistant reply",
        ),
        "no reply": ({**good, "messages": convo}, "must end with a user turn and the assistant reply"),
        "bad ids": ({**good, "reply_ids": ["x"]}, "reply_ids must be a non-empty list of token ids"),
        "bad kwargs": ({**good, "chat_template_kwargs": {"tools": []}}, "may only hold enable_thinking"),
    }
    for name, (row, message) in cases.items():
        path = write_rows(tmp_path / f"{name.replace(' ', '-')}.jsonl", [good, row])
        with pytest.raises(DataError, match=rf"\.jsonl:2: .*{message}"):
            load_jsonl(path, str(tmp_path / "tok"))
