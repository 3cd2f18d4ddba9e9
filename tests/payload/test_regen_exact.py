"""Regenerated chat rows train on exactly the tokens the target emitted (issue 28, item 2): the
builtin engine keeps the reply's token ids beside the messages, and the trainer's data path
supervises those ids after the prompt as regen rendered it, where re-encoding the reply's text
with a byte-level BPE gives other tokens."""

from __future__ import annotations

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


@pytest.mark.parametrize("thinking", [None, False])
def test_regenerated_chat_rows_train_on_the_targets_own_reply_tokens(tmp_path, thinking):
    tok = save_tokenizer(tmp_path / "tok", chat_template=THINK_TEMPLATE)
    vocab, mask_id, eos = len(tok), tok.convert_tokens_to_ids("<|MASK|>"), tok.eos_token_id
    convos = [CHATS[0][:4], CHATS[1][:1]] + [[{"role": "user", "content": f"Where did the {w} sit?"}]
                                             for w in ("cat", "dog", "frog", "hat")]
    src = write_rows(tmp_path / "chats.jsonl", [{"messages": c} for c in convos])
    out = tmp_path / "regen.jsonl"
    flag = [] if thinking is None else ["--thinking", "off"]
    assert regen.main(["--prompts", str(src), "--out", str(out), "--set", f"target.vocab_size={vocab}",
                       "--tokenizer", str(tmp_path / "tok"), "--max-new-tokens", str(NEW), "--batch-size", "3",
                       *flag]) == 0
    rows = read_jsonl(out)
    extra = {} if thinking is None else {"enable_thinking": thinking}
    prompts = [tok(tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True, **extra),
                   add_special_tokens=False)["input_ids"] for c in convos]
    emitted = [target_greedy(p, vocab, mask_id, eos) for p in prompts]
    # The precondition that makes this test mean something: re-encoding the replies' text (what
    # the trainer did with these rows before) gives tokens the target did not emit. Here the
    # random target emits byte tokens that are not whole UTF-8 characters, which decode to U+FFFD.
    renders = [tokenize_chat(r["messages"], tok) for r in rows]
    assert sum(ids[m].tolist() != e for (ids, m), e in zip(renders, emitted)) >= 2

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
    (seq, mask), = load_jsonl(write_rows(tmp_path / "ok.jsonl", [good]), str(tmp_path / "tok"))
    assert seq[mask].tolist() == ids and not mask[: -len(ids)].any()
    cases = {
        "edited": ({**good, "messages": convo + [{"role": "assistant", "content": "Hello you"}]},
                   "reply_ids do not decode to the assistant reply"),
        "no reply": ({**good, "messages": convo}, "must end with a user turn and the assistant reply"),
        "bad ids": ({**good, "reply_ids": ["x"]}, "reply_ids must be a non-empty list of token ids"),
        "bad kwargs": ({**good, "chat_template_kwargs": {"tools": []}}, "may only hold enable_thinking"),
    }
    for name, (row, message) in cases.items():
        path = write_rows(tmp_path / f"{name.replace(' ', '-')}.jsonl", [good, row])
        with pytest.raises(DataError, match=rf"\.jsonl:2: .*{message}"):
            load_jsonl(path, str(tmp_path / "tok"))
