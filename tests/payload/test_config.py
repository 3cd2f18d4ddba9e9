"""Config loading: presets, YAML, `--set` coercion, one-line errors with exit code 2."""

import subprocess
import sys
from pathlib import Path

import pytest

from dflash_train.__main__ import main
from dflash_train.config import ConfigError, load_config
from dflash_train.distributed import NodeEnv
from dflash_train.plan import auto_attention, resolve_run

PAYLOAD = Path(__file__).resolve().parents[2] / "remote_payload"


def test_yaml_then_overrides_with_coercion(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("run:\n  steps: 50\n  seed: 3\ndrafter:\n  block_size: 16\n")
    cfg = load_config(
        str(path),
        overrides=[
            "run.steps=7",
            "optim.lr=1e-3",
            "drafter.target_layer_ids=[1, 2]",
            "target.tie_word_embeddings=false",
            "run.gpus=0,1",
        ],
    )
    assert (cfg.run.steps, cfg.run.seed, cfg.drafter.block_size) == (7, 3, 16)
    assert cfg.optim.lr == 1e-3 and isinstance(cfg.optim.lr, float)
    assert cfg.drafter.target_layer_ids == [1, 2]
    assert cfg.target.tie_word_embeddings is False
    assert cfg.run.gpus == [0, 1]


@pytest.mark.parametrize(
    "override,message",
    [
        ("drafter.blok_size=3", "unknown config key 'drafter.blok_size'"),
        ("nosection.x=1", "unknown config key 'nosection.x'"),
        ("run.steps=abc", "run.steps must be int"),
        ("run.steps=2.5", "run.steps must be int"),
        ("target.tie_word_embeddings=3", "must be bool"),
        ("run.compile=fast", "run.compile must be one of"),
        ("run.steps", "not of the form key=value"),
        ("dist.heartbeat_s=0", "dist.heartbeat_s must be a positive number of seconds, got 0.0"),
        ("dist.timeout_s=-5", "dist.timeout_s must be a positive number of seconds"),
        ("dist.rendezvous_timeout_s=.inf", "dist.rendezvous_timeout_s must be a positive number of seconds"),
        ("dist.lost_after_s=1", "dist.lost_after_s 1 must exceed dist.heartbeat_s 1"),
        ("dist.lost_after_s=soon", "dist.lost_after_s must be float"),
        ("run.compile_timeout_s=0", "run.compile_timeout_s must be a positive number of seconds, got 0.0"),
        ("run.barrier_timeout_s=.inf", "run.barrier_timeout_s must be a positive number of seconds, got inf"),
        ("run.threads=-1", "run.threads must be >= 0"),
    ],
)
def test_bad_overrides_raise_one_line_errors(override, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_config(overrides=[override])
    assert "\n" not in str(err.value)


def test_dist_section_from_yaml_and_overrides_reaches_the_node_group(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("dist:\n  timeout_s: 600\n  heartbeat_s: 0.5\n")
    cfg = load_config(str(path), overrides=["dist.rendezvous_timeout_s=2"])
    assert (cfg.dist.timeout_s, cfg.dist.rendezvous_timeout_s, cfg.dist.heartbeat_s, cfg.dist.lost_after_s) == (
        600.0,
        2.0,
        0.5,
        15.0,
    )
    assert isinstance(cfg.dist.timeout_s, float)
    # The config, not the environment, sets the group's timeouts (the old DFLASH_*_S switches are gone).
    environ = {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "10.0.0.5",
        "MASTER_PORT": "29500",
        "DFLASH_RDZV_TIMEOUT_S": "9",
    }
    env = NodeEnv.from_env(cfg.dist, environ)
    assert (env.timeout_s, env.rendezvous_timeout_s, env.heartbeat_s, env.lost_after_s) == (600.0, 2.0, 0.5, 15.0)
    path.write_text("dist:\n  heartbeat_s: 20\n")
    with pytest.raises(ConfigError, match=r"^dist.lost_after_s 15 must exceed dist.heartbeat_s 20$"):
        load_config(str(path))


def test_bare_off_is_a_string_not_false(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("run:\n  compile: off\n")
    assert load_config(str(path)).run.compile == "off"
    assert load_config(overrides=["run.compile=off"]).run.compile == "off"


def test_plain_strings_stay_strings_without_quotes():
    cfg = load_config(
        overrides=[
            "run.export_dir={run_dir}/export",
            "run.output_dir={run_dir}",
            "data.train_path=a: b",
            "target.path=12",
            "run.device='cuda:0'",
        ]
    )
    assert (cfg.run.export_dir, cfg.run.output_dir) == ("{run_dir}/export", "{run_dir}")
    assert (cfg.data.train_path, cfg.target.path, cfg.run.device) == ("a: b", "12", "cuda:0")
    assert load_config(overrides=["target.path=null"]).target.path is None  # YAML still speaks for null


@pytest.mark.parametrize("override", ["run.steps=[", "run.gpus=[0,", "optim.lr={x}"])
def test_a_value_yaml_cannot_read_names_its_key(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"^{key}") as err:
        load_config(overrides=[override])
    assert "\n" not in str(err.value)


def test_unknown_yaml_key_and_preset(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  maxlen: 3\n")
    with pytest.raises(ConfigError, match="unknown config key 'data.maxlen'"):
        load_config(str(path))
    with pytest.raises(ConfigError, match="unknown preset"):
        load_config(preset="qwen9")


@pytest.mark.parametrize("section", ["target", "run", "debug"])
def test_a_section_given_a_value_says_it_is_a_section(section):
    """`--set target=5` said `unknown config key 'target'`, naming target among the sections."""
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[f"{section}=5"])
    assert str(err.value).startswith(f"{section} is a section: give {section}.KEY=VALUE (keys: ")


@pytest.mark.parametrize("override", ["preset=qwen3-8b", "preset.x=1"])
def test_preset_is_not_a_key_to_set(override):
    """`preset` was listed among the sections; `preset.x=1` raised a TypeError, not a ConfigError."""
    with pytest.raises(ConfigError, match=r"is not a key to set: give --preset NAME"):
        load_config(overrides=[override])
    with pytest.raises(ConfigError, match=r"\(sections: target, drafter, data, optim, run, dist, debug\)$"):
        load_config(overrides=["nosection.x=1"])


def test_cli_exit_code_2_and_one_line(capsys):
    assert main(["--set", "optim.lrr=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown config key 'optim.lrr'") and err.count("\n") == 1


def test_cli_bad_config_in_a_fresh_process():
    proc = subprocess.run(
        [sys.executable, "-m", "dflash_train", "--set", "run.steps=0"],
        cwd=PAYLOAD,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: run.steps must be positive"


@pytest.mark.parametrize(
    "rows, expected",
    [
        ('{"input_ids": [1, 2, 3]}\n{"input_ids": [1, 2\n', "bad.jsonl:2: not JSON (Expecting ',' delimiter)"),
        ('{"input_ids": [[1], [2, 3]]}\n', "bad.jsonl:1: input_ids and loss_mask must be flat lists of integers"),
        (None, "No such file or directory"),
    ],
    ids=["truncated line", "ragged ids", "missing file"],
)
def test_bad_data_file_is_one_line_in_a_fresh_process(tmp_path, rows, expected):
    path = tmp_path / "bad.jsonl"
    if rows is not None:
        path.write_text(rows)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash_train",
            "--set",
            "data.source=jsonl",
            "--set",
            f"data.train_path={path}",
            "--set",
            f"run.output_dir={tmp_path / 'run'}",
        ],
        cwd=PAYLOAD,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: data: ") and expected in lines[0], proc.stderr


def test_qwen3_8b_preset_resolves_to_the_published_recipe():
    cfg = resolve_run(load_config(preset="qwen3-8b", overrides=["run.device=cpu"])).cfg
    assert cfg.drafter.target_layer_ids == [1, 9, 17, 25, 33]
    assert (cfg.drafter.num_layers, cfg.drafter.block_size, cfg.drafter.mask_token_id) == (5, 16, 151669)
    assert (cfg.data.max_length, cfg.data.anchors_per_seq) == (3072, 512)
    assert cfg.optim.gamma == 7.0 and cfg.optim.lr == 6e-4
    assert cfg.run.dtype == "bf16"


@pytest.mark.parametrize(
    "on_cuda, compile_mode, expected",
    [(True, "default", "flex"), (True, "cudagraphs", "flex"), (True, "off", "dense"), (False, "off", "dense")],
)
def test_auto_attention_compiles_nothing_when_compile_is_off(on_cuda, compile_mode, expected):
    # run.compile off is the way around a broken compiler: auto must not pick the compiled flex
    assert auto_attention(on_cuda, compile_mode) == expected


def test_resolve_rejects_layer_ids_outside_the_target():
    with pytest.raises(ConfigError, match="target_layer_ids"):
        resolve_run(load_config(overrides=["drafter.target_layer_ids=[1, 6]"])).cfg


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            b"run:\n  steps: 5\n  log_every: 1\n  steps: 7\n",
            "line 4, column 3: duplicate key 'steps' (first on line 2)",
        ),
        (b"run:\n  steps: 5\nrun:\n  steps: 7\n", "line 3, column 1: duplicate key 'run' (first on line 1)"),
        (b"target:\n  rope_scaling:\n    factor: 8\n    factor: 2\n", "line 4, column 5: duplicate key 'factor'"),
        (b"run: {steps: 5, steps: 7}\n", "line 1, column 17: duplicate key 'steps' (first on line 1)"),
        (b"run:\n  steps: 5\n  output_dir: caf\xe9\n", "line 3, column 18: not UTF-8 text (byte 0xe9)"),
    ],
    ids=["nested", "top level", "deeper", "one line", "bad utf-8"],
)
def test_a_duplicate_key_or_bad_utf8_names_file_and_line(tmp_path, text, expected):
    path = tmp_path / "run.yaml"
    path.write_bytes(text)
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    message = str(err.value)
    assert message.startswith(f"config {path}: ") and expected in message and "\n" not in message


def test_a_merge_key_may_repeat_the_keys_it_merges(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("target:\n  rope_scaling:\n    <<: &base {factor: 8, rope_type: llama3}\n    factor: 2\n")
    assert load_config(str(path)).target.rope_scaling == {"factor": 2, "rope_type": "llama3"}


def test_a_duplicate_key_is_exit_2_and_one_line_in_the_trainer(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("run:\n  steps: 5\n  steps: 7\n")
    assert main(["--config", str(path), "--preflight"]) == 2
    out = capsys.readouterr().out
    assert '"error": "config"' in out and "line 3, column 3: duplicate key 'steps'" in out
