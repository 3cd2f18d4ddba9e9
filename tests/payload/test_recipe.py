"""The recipe follows the target (issue 26): a run with target.path and no --preset gets the
real-target preset, whose depth and sequence shapes come from the target's size; anything the user
sets explicitly wins; the random-weight presets say what they are."""

import json

import pytest

from dflash_train.config import ConfigError, load_config
from dflash_train.recipe import recipe_for_target
from dflash_train.plan import resolve_run
from dflash_train.resolve import summary


def hf_dir(tmp_path, hidden: int, layers: int = 4):
    """A config.json of a Qwen3 of this width (resolution reads nothing else)."""
    path = tmp_path / f"qwen3-{hidden}"
    path.mkdir()
    (path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen3",
                "num_hidden_layers": layers,
                "hidden_size": hidden,
                "intermediate_size": 3 * hidden,
                "num_attention_heads": 8,
                "num_key_value_heads": 4,
                "head_dim": hidden // 8,
                "vocab_size": 1000,
            }
        )
    )
    return path


def resolved(*sets, preset=None):
    if any(s.startswith("target.path=") for s in sets):  # the config.json has no tokenizer beside it
        sets = ["drafter.mask_token_id=999", *sets]
    sets = ["run.device=cpu", *sets]
    plan = resolve_run(load_config(preset=preset, overrides=sets))
    return plan.cfg, list(plan.notes)


def test_a_real_target_without_a_preset_gets_the_recipe_for_its_size(tmp_path):
    cfg, notes = resolved(f"target.path={hf_dir(tmp_path, 768)}")
    small = recipe_for_target(768)
    assert cfg.preset == "real-target" and cfg.drafter.block_size == 16
    assert (
        (cfg.drafter.num_layers, cfg.data.max_length, cfg.data.anchors_per_seq, cfg.data.batch_size)
        == (small.num_layers, small.max_length, small.anchors_per_seq, small.batch_size)
        == (3, 512, 64, 32)
    )
    assert cfg.run.steps is None  # decided from the data's size when the run loads it
    recipe = next(n for n in notes if n.startswith("recipe: "))
    assert "drafter.num_layers 3" in recipe and "hidden size 768 < 2048" in recipe
    assert summary(cfg, [])[0].startswith("preset: real-target (the recipe for a real checkpoint")


def test_a_large_target_gets_the_published_drafter_shapes(tmp_path):
    cfg, _ = resolved(f"target.path={hf_dir(tmp_path, 4096)}")
    assert (cfg.drafter.num_layers, cfg.data.max_length, cfg.data.anchors_per_seq, cfg.data.batch_size) == (
        5,
        3072,
        512,
        1,
    )


def test_what_the_user_sets_wins_over_the_recipe(tmp_path):
    cfg, notes = resolved(
        f"target.path={hf_dir(tmp_path, 768)}", "drafter.num_layers=2", "data.max_length=256", "run.steps=40"
    )
    assert (cfg.drafter.num_layers, cfg.data.max_length, cfg.run.steps) == (2, 256, 40)
    assert cfg.data.anchors_per_seq == 64  # still the recipe's
    assert "drafter.num_layers" not in next(n for n in notes if n.startswith("recipe: "))


def test_an_explicit_preset_keeps_its_recipe_and_says_so(tmp_path):
    cfg, _ = resolved(f"target.path={hf_dir(tmp_path, 768)}", preset="tiny")
    assert cfg.preset == "tiny" and (cfg.drafter.num_layers, cfg.drafter.block_size, cfg.run.steps) == (1, 8, 300)
    assert "the tiny preset's recipe on a real target" in summary(cfg, [])[0]


def test_without_a_target_path_the_tiny_preset_and_the_random_presets_say_what_they_are():
    cfg, _ = resolved()
    assert cfg.preset == "tiny" and summary(cfg, [])[0].startswith("preset: tiny (a random tiny target")
    cfg, _ = resolved(preset="qwen3-8b")
    assert "random weights on random tokens" in summary(cfg, [])[0] and "never quality" in summary(cfg, [])[0]


def test_the_resolved_config_reloads_to_the_same_run(tmp_path):
    from dflash_train.config import dump_yaml, to_dict

    cfg, _ = resolved(f"target.path={hf_dir(tmp_path, 768)}", "run.steps=50")
    (tmp_path / "resolved.yaml").write_text(dump_yaml(cfg))
    assert to_dict(load_config(str(tmp_path / "resolved.yaml"))) == to_dict(cfg)


def test_a_recipe_field_set_to_zero_is_refused():
    with pytest.raises(ConfigError, match="drafter.num_layers must be positive"):
        load_config(overrides=["drafter.num_layers=0"])


def train_on_a_real_tiny_target(tmp_path, *sets: str) -> list[str]:
    """The trainer's log of a run on a tiny HF target and 34 jsonl rows (32 train: 2 batches of 16,
    set here so the run-length rule is tested apart from the recipe's batch size)."""
    import torch
    from dflash_train.config import TargetConfig
    from dflash_train.target import build_tiny_target
    from dflash_train.train import run_training
    from test_target import write_hf_checkpoint

    write_hf_checkpoint(build_tiny_target(TargetConfig(), seed=0), tmp_path / "target", tie=True)
    gen = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(0, 511, (40,), generator=gen).tolist()} for _ in range(34)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(
        overrides=[
            f"target.path={tmp_path / 'target'}",
            "drafter.mask_token_id=511",
            "data.source=jsonl",
            f"data.train_path={tmp_path / 'train.jsonl'}",
            "data.eval_fraction=0.06",
            "data.max_length=48",
            "data.anchors_per_seq=4",
            "data.batch_size=16",
            "run.spec_prompts=0",
            f"run.output_dir={tmp_path / 'run'}",
            *sets,
        ]
    )
    logs: list[str] = []
    assert run_training(cfg, log=logs.append) == 0
    return logs


def test_without_run_steps_a_real_target_trains_the_recipes_epochs_of_its_data(tmp_path):
    from dflash_train.recipe import DEFAULT_EPOCHS

    logs = train_on_a_real_tiny_target(tmp_path)
    # 32 training rows in batches of 16: 2 steps an epoch.
    assert f"run length: {DEFAULT_EPOCHS * 2} steps = {DEFAULT_EPOCHS} epochs of 2 batches" in "\n".join(logs)
    assert any(line.startswith("preset: real-target") for line in logs)


def test_a_real_target_run_evaluates_and_checkpoints_on_the_cadence_of_its_length(tmp_path):
    from dflash_train.recipe import cadence_for

    logs = train_on_a_real_tiny_target(tmp_path, "run.steps=40", "run.log_every=2")
    assert cadence_for(40, 2) == (4, 4)
    said = "cadence: an evaluation every 4 steps, a checkpoint every 4 (run.eval_every, run.checkpoint_every unset: "
    assert said in "\n".join(logs)
    evaluated = [int(line.split()[2].rstrip(":")) for line in logs if line.startswith("eval step ")]
    assert evaluated == list(range(0, 41, 4))  # step 0, 9 on the cadence, the final one
    resolved = (tmp_path / "run" / "config.resolved.yaml").read_text()
    assert "eval_every: 4" in resolved and "checkpoint_every: 4" in resolved  # a resume reads these back


def test_a_cadence_set_by_the_user_is_kept_and_the_other_follows_the_run(tmp_path):
    logs = train_on_a_real_tiny_target(tmp_path, "run.steps=40", "run.log_every=2", "run.eval_every=20")
    said = "cadence: an evaluation every 20 steps, a checkpoint every 4 (run.checkpoint_every unset: "
    assert said in "\n".join(logs)


def test_the_cadence_rule():
    from dflash_train.recipe import CHECKPOINT_STEPS, EVALUATIONS, cadence_for

    assert cadence_for(81_920, 10) == (8_200, CHECKPOINT_STEPS)  # 10 epochs of 65,536 rows on 8 GPUs at 8B
    assert cadence_for(19_457, 10) == (1_950, CHECKPOINT_STEPS)  # the quality bench's default run
    assert cadence_for(20, 10) == (10, 10)
    for steps in (1, 7, 99, 100, 101, 12_345, 10**6):
        for log_every in (1, 3, 10, 700):
            eval_every, checkpoint_every = cadence_for(steps, log_every)
            assert eval_every % log_every == 0 and checkpoint_every % log_every == 0
            assert steps // eval_every <= EVALUATIONS  # evaluations before the final one
            assert checkpoint_every <= eval_every and checkpoint_every <= max(CHECKPOINT_STEPS, log_every)


def test_many_epochs_of_a_real_targets_rows_are_named_at_start(tmp_path):
    from dflash_train.recipe import MANY_EPOCHS

    steps = (MANY_EPOCHS + 1) * 2  # 2 batches an epoch
    logs = train_on_a_real_tiny_target(tmp_path, f"run.steps={steps}")
    note = [line for line in logs if line.startswith("run length: ")]
    assert note == [
        f"run length: {steps} steps = {MANY_EPOCHS + 1} epochs of 2 batches; on the quality bench 37 epochs "
        "memorised the rows where ~10 epochs of twice the rows reached 1.4x the tau (docs/quality.md): "
        "regenerate more prompts, or set run.epochs=10"
    ]


def test_the_epochs_rule():
    from dflash_train.recipe import MANY_EPOCHS, epochs_note

    assert epochs_note(MANY_EPOCHS * 100, 100) is None  # at the limit: quiet
    assert epochs_note(MANY_EPOCHS * 100 + 1, 100).startswith(f"run length: {MANY_EPOCHS * 100 + 1} steps = ")
    assert epochs_note(36000, 972).startswith("run length: 36000 steps = 37 epochs of 972 batches; ")
