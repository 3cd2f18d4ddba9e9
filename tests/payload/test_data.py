"""Anchor sampling, deterministic batches, JSONL rows, chat rows through a real (tiny, locally
built) tokenizer and a short training run on them."""

import json
import math
import sys

import pytest
import torch

from dflash_train.config import DataConfig, load_config
from dflash_train.data import BlockSampler, DataError, build_datasets, load_jsonl, sample_anchors, seeded_generator
from dflash_train.plan import resolve_run
from dflash_train.train import run_training, spec_prompts


def test_anchors_predict_a_supervised_token_and_have_room_for_a_block():
    mask = torch.zeros(40, dtype=torch.bool)
    mask[10:40] = True
    for seed in range(20):
        anchors, valid = sample_anchors(mask, 6, 8, seeded_generator(seed))
        assert valid.all()
        assert (anchors >= 9).all() and (anchors + 8 <= 40).all()  # 9: the prompt's last token starts the reply
        assert mask[anchors + 1].all()
        assert anchors.unique().numel() == 6 and torch.equal(anchors, anchors.sort().values)


def test_no_anchor_sits_where_the_next_token_is_unsupervised():
    """Multi-turn: the last token of an assistant turn is followed by the user's (unsupervised)
    tokens; a block anchored there would train with zero weight."""
    mask = torch.tensor([0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0], dtype=torch.bool)
    for seed in range(30):
        anchors, valid = sample_anchors(mask, 20, 4, seeded_generator(seed))
        chosen = anchors[valid]
        assert sorted(chosen.tolist()) == [2, 3, 4, 9, 10, 11, 12]  # every a with mask[a+1], room for 4


def test_short_sequences_pad_with_invalid_anchors():
    mask = torch.ones(10, dtype=torch.bool)
    anchors, valid = sample_anchors(mask, 5, 8, seeded_generator(0))  # positions 0..2 fit a block
    assert valid.tolist() == [True, True, True, False, False]
    assert anchors[:3].tolist() == [0, 1, 2]


def _seqs(n, length=32):
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 100, (length,), generator=g), torch.ones(length, dtype=torch.bool)) for _ in range(n)]


def test_batches_are_a_pure_function_of_step():
    cfg = DataConfig(max_length=32, anchors_per_seq=4, batch_size=4)
    a = BlockSampler(_seqs(12), cfg, block_size=4, seed=3)
    b = BlockSampler(_seqs(12), cfg, block_size=4, seed=3)
    assert a.steps_per_epoch == 3
    for step in (5, 0, 4):
        x, y = a.batch(step), b.batch(step)
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.anchors, y.anchors)
    # A new epoch reshuffles and resamples anchors.
    assert not torch.equal(a.batch(0).anchors, a.batch(3).anchors)


def test_jsonl_rows(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(
        json.dumps({"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}) + "\n\n" + json.dumps({"input_ids": [1, 2]}) + "\n"
    )
    seqs = load_jsonl(path)
    assert [s[0].tolist() for s in seqs] == [[5, 6, 7], [1, 2]]
    assert [s[1].tolist() for s in seqs] == [[False, True, True], [True, True]]
    path.write_text(json.dumps({"input_ids": [1, 2], "loss_mask": [1]}) + "\n")
    with pytest.raises(ValueError, match="differ in length"):
        load_jsonl(path)


@pytest.mark.parametrize("ids", [[1, "2"], [1, [2]], [1, 2.5], [1, None], 7, [1, 2**63]])
def test_a_token_row_that_is_not_a_flat_list_of_integers_names_its_line(tmp_path, ids):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"input_ids": [5, 6]}) + "\n" + json.dumps({"input_ids": ids}) + "\n")
    with pytest.raises(ValueError, match=r"d\.jsonl:2: input_ids and loss_mask must be flat lists of integers"):
        load_jsonl(path)


def test_token_rows_and_chat_rows_keep_the_files_order(tmp_path):
    save_tokenizer(tmp_path / "tok")
    path = tmp_path / "mixed.jsonl"
    rows = [{"input_ids": [5, 6, 7]}, {"messages": CHATS[0]}, {"input_ids": [8], "loss_mask": [0]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    seqs = load_jsonl(path, str(tmp_path / "tok"))
    ((chat_ids, _),) = load_jsonl(write_chats(tmp_path / "one.jsonl", [CHATS[0]]), str(tmp_path / "tok"))
    assert [s[0].tolist() for s in seqs] == [[5, 6, 7], chat_ids.tolist(), [8]]
    assert [s[1].dtype for s in seqs] == [torch.bool] * 3 and seqs[2][1].tolist() == [False]


def test_chat_rows_without_transformers_say_so(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed: import fails
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(
        ValueError,
        match=r"chat rows, which need the `transformers` package; install it "
        r"or pre-tokenise to input_ids/loss_mask",
    ):
        load_jsonl(path, tokenizer_path=str(tmp_path))


def test_chat_rows_need_a_local_tokenizer_directory(tmp_path):
    # A hub name would make from_pretrained download mid-run; it is refused before that call.
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(
        ValueError,
        match=r"Qwen/Qwen3-8B is not a tokenizer directory \(no tokenizer_config\.json\); "
        r"data\.tokenizer_path must be a local directory",
    ):
        load_jsonl(path, tokenizer_path="Qwen/Qwen3-8B")


# ----------------------------------------------------------------------------------------------
# Chat rows, with a byte-level BPE tokenizer trained here (nothing comes from a model hub).

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen3's quirk, reduced: only the last assistant turn gets an (empty) think block.
LAST_TURN_THINKS = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and loop.last %}<think>\n\n</think>\n\n{% endif %}"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
)

CHATS = [
    [
        {"role": "system", "content": "You are brief."},
        {"role": "user", "content": "Where did the cat sit?"},
        {"role": "assistant", "content": "The cat sat on the mat, as cats do."},
        {"role": "user", "content": "And the dog?"},
        {"role": "assistant", "content": "The dog sat on the log, next to the frog!"},
    ],
    [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello there, how are you today?"}],
]


def save_tokenizer(path, chat_template=CHATML):
    """A ~300-token byte-level BPE with ChatML specials, saved as an HF tokenizer dir at `path`."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        [m["content"] for chat in CHATS for m in chat] + ["system user assistant"],
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=SPECIAL,
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=chat_template
    )
    hf.save_pretrained(path)
    return hf


def write_chats(path, chats):
    path.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in chats))
    return path


def assistant_text(chat) -> str:  # type: ignore[no-untyped-def]
    """What the mask must cover, independent of the loader: each reply and its end-of-turn token."""
    return "".join(m["content"] + "<|im_end|>" for m in chat if m["role"] == "assistant")


def test_chat_rows_mask_exactly_the_assistant_replies(tmp_path):
    tok = save_tokenizer(tmp_path / "tok")
    seqs = load_jsonl(write_chats(tmp_path / "chat.jsonl", CHATS), tokenizer_path=str(tmp_path / "tok"))
    assert len(seqs) == len(CHATS)
    for chat, (ids, mask) in zip(CHATS, seqs):
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in chat)
        assert tok.apply_chat_template(chat, tokenize=False) == text
        assert ids.tolist() == tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids[mask].tolist()) == assistant_text(chat)
        assert not mask[0]


def test_multi_turn_chats_whose_template_rewrites_earlier_turns_train(tmp_path):
    """Qwen3's template gives only the last assistant turn an (empty) think block: rendering each
    prefix disagrees with the whole, so the masks come from the whole conversation's rendering."""
    tok = save_tokenizer(tmp_path / "tok", chat_template=LAST_TURN_THINKS)
    ((ids, mask),) = load_jsonl(write_chats(tmp_path / "multi.jsonl", [CHATS[0]]), str(tmp_path / "tok"))
    assert tok.decode(ids[mask].tolist()) == assistant_text(CHATS[0])  # both replies, no think block
    assert "<think>" in tok.decode(ids.tolist())


def test_a_template_that_rewrites_content_is_an_error(tmp_path):
    save_tokenizer(tmp_path / "tok", chat_template="{% for m in messages %}{{ m['content'] | upper }}{% endfor %}")
    with pytest.raises(ValueError, match=r"up\.jsonl:1: message 0 \(user\) does not appear as written"):
        load_jsonl(write_chats(tmp_path / "up.jsonl", [CHATS[1]]), str(tmp_path / "tok"))


def chat_run_overrides(tmp_path):
    """A tiny jsonl run on chat rows (10 conversations: 9 train, 1 held out) with a random target
    whose vocabulary is the tokenizer's."""
    vocab_size = len(save_tokenizer(tmp_path / "tok"))
    data = write_chats(tmp_path / "chat.jsonl", CHATS * 5)
    return [
        f"run.output_dir={tmp_path / 'run'}",
        "data.source=jsonl",
        f"data.train_path={data}",
        f"data.tokenizer_path={tmp_path / 'tok'}",
        f"target.vocab_size={vocab_size}",
        "target.num_layers=4",
        "data.batch_size=4",
    ]


def test_chat_jsonl_trains_end_to_end(tmp_path):
    sets = chat_run_overrides(tmp_path)
    tok_mask = json.loads((tmp_path / "tok" / "tokenizer.json").read_text())["added_tokens"][3]
    assert tok_mask["content"] == "<|MASK|>"
    cfg = load_config(overrides=sets + ["run.steps=4", "run.log_every=1", "run.eval_every=2", "run.checkpoint_every=4"])
    # MASK is the tokenizer's <|MASK|>, not the random target's last id (a real BPE token here).
    assert resolve_run(cfg).cfg.drafter.mask_token_id == tok_mask["id"]
    logs = []
    assert run_training(cfg, log=logs.append) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["event"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in train)
    assert logs[-1].startswith("final held-out teacher-forced acceptance length")
    exported = json.loads((tmp_path / "run" / "export" / "config.json").read_text())
    assert exported["dflash_config"]["mask_token_id"] == tok_mask["id"]


def test_token_ids_beyond_the_target_vocabulary_are_an_error(tmp_path):
    sets = chat_run_overrides(tmp_path)
    top = max(int(ids.max()) for ids, _ in load_jsonl(tmp_path / "chat.jsonl", str(tmp_path / "tok")))
    train, held_out = build_datasets(load_config(overrides=sets + [f"target.vocab_size={top + 1}"]), 3)
    assert len(train) == 9 and len(held_out) == 1
    with pytest.raises(
        ValueError,
        match=rf"chat\.jsonl has token id {top}, outside the target's "
        rf"vocabulary \({top}\)",
    ):
        build_datasets(load_config(overrides=sets + [f"target.vocab_size={top}"]), 3)
    small = tmp_path / "small.jsonl"
    small.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n")
    with pytest.raises(ValueError, match=rf"chat\.jsonl has token id {top}"):  # the eval file's
        build_datasets(
            load_config(
                overrides=sets
                + [f"target.vocab_size={top}", f"data.train_path={small}", f"data.eval_path={tmp_path / 'chat.jsonl'}"]
            ),
            3,
        )


def test_a_negative_token_id_is_an_error_not_the_embeddings_failure(tmp_path):
    path = tmp_path / "neg.jsonl"  # a hand-copied file: `data push` refuses the row
    path.write_text("".join(json.dumps({"input_ids": [5, -1] + list(range(1, 40))}) + "\n" for _ in range(4)))
    with pytest.raises(DataError, match=r"neg\.jsonl has token id -1, which no token has \(ids start at 0\)"):
        build_datasets(load_config(overrides=["data.source=jsonl", f"data.train_path={path}"]), 3)


@pytest.mark.parametrize(
    "field, value, said",
    [("path", "/models/any", "needs the random target"), ("backend", "transformers", "needs the native random")],
)
def test_the_demo_source_refuses_a_target_it_cannot_generate_with(field, value, said):
    cfg = load_config()  # the demo source
    setattr(cfg.target, field, value)
    with pytest.raises(DataError, match=said):
        build_datasets(cfg, 0)
    with pytest.raises(ValueError, match=said):  # eval's default prompts: the same refusal, not demo prompts
        spec_prompts(cfg)
