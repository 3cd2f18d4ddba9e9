"""The model card `runs pull` writes into a pulled export (README.md in the Hugging Face Hub's
format: YAML front matter, then Markdown), so that `huggingface-cli upload ORG/NAME EXPORT`
publishes it as it is. Everything comes from the pulled run directory: run.json,
config.resolved.yaml, metrics.jsonl, eval.json (and eval-*.json) and the export itself (docs/runs.md).
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

import yaml

from . import __version__
from .figures import prompts_text
from .serving import check_export, dflash_value, safetensors_metadata, serve_commands

CARD = "README.md"
TAGS = ["dflash", "speculative-decoding", "block-diffusion", "draft-model", "dflashctl"]
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # ORG/NAME; a path in the container has more parts or a leading /


def card_after_pull(run_dir: Path, base_model: str | None, license_id: str) -> str | None:
    """Write the card of a pulled run that has an export; the line to tell the user (None: no export).
    A card that cannot be written does not undo the pull: the line says why."""
    if not (run_dir / "export" / "config.json").is_file():
        return None
    try:
        path, note = write_model_card(run_dir, base_model, license_id)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"model card not written: {exc}"
    return f"model card: {path}" + (f" ({note})" if note else "")


def write_model_card(
    run_dir: Path, base_model: str | None = None, license_id: str = "other"
) -> tuple[Path, str | None]:
    """Write run_dir/export/README.md; returns its path and a note for the user (or None)."""
    run = _read_json(run_dir / "run.json") or {}
    config = _resolved_config(run_dir, run)
    export = run_dir / "export"
    exported = json.loads((export / "config.json").read_text())
    target_path = (config.get("target") or {}).get("path")
    note = None
    if base_model is None and target_path and HUB_ID.match(target_path):
        base_model = target_path
    elif base_model is None:
        note = (
            "base_model left out of the model card (the target was "
            f"{'the random ' + str(config.get('preset')) + ' preset' if not target_path else target_path}): "
            "pass --base-model ORG/NAME to name it"
        )
    front: dict[str, Any] = {"license": license_id}
    if base_model:
        front["base_model"] = base_model
    front.update({"library_name": "transformers", "tags": TAGS, "pipeline_tag": "text-generation"})
    body = _body(run_dir, run, config, exported, base_model, target_path)
    path = export / CARD
    path.write_text("---\n" + yaml.safe_dump(front, sort_keys=False) + "---\n\n" + body)
    return path, note


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _resolved_config(run_dir: Path, run: dict) -> dict:
    """The trainer's resolved config (every `auto` decided), else the config run.json recorded."""
    try:
        loaded = yaml.safe_load((run_dir / "config.resolved.yaml").read_text())
    except (OSError, yaml.YAMLError):
        loaded = None
    return loaded if isinstance(loaded, dict) else (run.get("config") or {})


def _metrics(run_dir: Path) -> list[dict]:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return []
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            continue  # a line cut by a stopped run
    return records


def _body(
    run_dir: Path, run: dict, config: dict, exported: dict, base_model: str | None, target_path: str | None
) -> str:
    name = run.get("name") or run.get("run_id") or run_dir.name
    target = (
        base_model
        or target_path
        or f"the random `{config.get('preset')}` preset target (its tau says nothing about a real model's)"
    )
    block = dflash_value(exported, "block_size")
    lines = [
        f"# {name}",
        "",
        f"A [DFlash](https://arxiv.org/abs/2602.06036) drafter (block diffusion, block size {block}) for "
        f"speculative decoding of **{target}**, trained with dflashctl.",
        "",
    ]
    lines += _section("Target", _target_lines(config, exported, target_path))
    lines += _section("Data", _data_lines(config, run_dir))
    records = _metrics(run_dir)
    lines += _section("Training", _training_lines(config, run, records))
    lines += _section("Acceptance length (tau) and speedup", _tau_lines(run_dir, records, config))
    lines += _section("Hardware", _hardware_lines(run, run_dir / "export"))
    lines += _section("Use", _use_lines(exported, base_model or target_path or "TARGET"))
    lines += _section("Serving check", _serving_check_lines(run_dir / "export"))
    lines += [
        f"Written by dflashctl {__version__} (`runs pull` of run `{run.get('run_id', run_dir.name)}`; "
        f"trainer payload {str(run.get('payload_hash') or 'unknown')[:12]}).",
        "",
    ]
    return "\n".join(lines)


def _section(title: str, lines: list[str]) -> list[str]:
    return [f"## {title}", "", *lines, ""]


def _target_lines(config: dict, exported: dict, target_path: str | None) -> list[str]:
    t = config.get("target") or {}
    ids = dflash_value(exported, "target_layer_ids")
    return [
        f"- target: `{target_path}`" if target_path else f"- target: random weights (`{config.get('preset')}` preset)",
        f"- target shape: {t.get('num_layers')} layers, hidden size {t.get('hidden_size')}, "
        f"vocabulary {exported.get('vocab_size')}",
        f"- drafter: {exported.get('num_hidden_layers')} layer(s), hidden size {exported.get('hidden_size')}, "
        f"block size {dflash_value(exported, 'block_size')}, context features from target layers {ids}, "
        f"MASK token id {dflash_value(exported, 'mask_token_id')}; weights in {exported.get('torch_dtype')}",
    ]


def _data_lines(config: dict, run_dir: Path) -> list[str]:
    d = config.get("data") or {}
    source = d.get("source")
    if source == "jsonl":
        where = f"JSON lines `{d.get('train_path')}`" + (
            f", held out `{d['eval_path']}`" if d.get("eval_path") else f", {d.get('eval_fraction')} held out"
        )
    elif source == "demo":
        where = "the target's own greedy continuations of random prompts (the demo data)"
    else:
        where = f"{source} token sequences (speed runs: nothing to learn)"
    lines = [f"- source: {where}"]
    seqs = _log_number(run_dir, r"(\d+) training sequences")
    if seqs is not None:
        lines.append(f"- training sequences: {seqs}")
    lines.append(
        f"- sequence length {d.get('max_length')}, {d.get('anchors_per_seq')} anchors per sequence, "
        f"batch size {d.get('batch_size')}"
    )
    return lines


def _log_number(run_dir: Path, pattern: str) -> int | None:
    try:
        match = re.search(pattern, (run_dir / "train.log").read_text(errors="replace"))
    except OSError:
        return None
    return int(match.group(1)) if match else None


def _training_lines(config: dict, run: dict, records: list[dict]) -> list[str]:
    o, r = config.get("optim") or {}, config.get("run") or {}
    trained = [rec for rec in records if rec.get("event", "train") == "train"]  # records before events: train
    last = trained[-1] if trained else {}
    steps = f"{last['step']} of {last.get('total_steps')} steps" if last else "no step logged"
    lines = [
        f"- steps: {steps}; final training loss {last['loss']:.4f}"
        if last.get("loss") is not None
        else f"- steps: {steps}",
        f"- recipe: preset `{config.get('preset')}`, AdamW lr {o.get('lr')} (warm-up {o.get('warmup_ratio')}, "
        f"then cosine to {o.get('min_lr_ratio')}), weight decay {o.get('weight_decay')}, grad clip "
        f"{o.get('grad_clip')}, loss position decay gamma {o.get('gamma')}, {r.get('dtype')}, seed {r.get('seed')}",
    ]
    if run.get("overrides"):
        lines.append(f"- settings given: {', '.join(f'`{o}`' for o in run['overrides'])}")
    return lines


def _tau_lines(run_dir: Path, records: list[dict], config: dict) -> list[str]:
    lines = []
    final = next((rec for rec in reversed(records) if rec.get("event") == "final"), None)
    if final is not None:
        lines.append(
            f"- in training, teacher-forced acceptance length (a proxy: drafts at random anchors of "
            f"held-out text with the true context): {final['acceptance_length']:.3f}"
        )
        if final.get("spec_tau") is not None:
            tokens = (config.get("run") or {}).get("spec_new_tokens")
            lines.append(
                f"- in training, speculative tau (real draft-and-verify decoding, greedy, "
                f"{final.get('spec_prompts')} held-out prompts x {tokens} tokens): "
                + _mean_tau(final.get("spec_tau_prompt_mean"))
                + f"{final['spec_tau']:.3f} pooled over all verify steps"
            )
    report = _read_json(run_dir / "eval.json")
    if report is not None:
        lines += _eval_lines(report, "`dflashctl eval`")
    else:
        lines.append("- `dflashctl eval`: not run before this pull (`dflashctl eval HOST RUN`, then pull again)")
    for path in sorted(run_dir.glob("eval-*.json")):  # `dflashctl eval --prompts FILE`: on FILE's prompts
        other = _read_json(path)
        if other is not None:
            lines += _eval_lines(other, f"`dflashctl eval --prompts` on `{path.stem[len('eval-') :]}`")
    return lines


def _eval_lines(report: dict, what: str) -> list[str]:
    """One eval report's figures: tau (both forms), identity, speedup, the free baseline."""
    how = "greedy" if not report.get("temperature") else f"sampled at temperature {report['temperature']}"
    lines = [
        f"- {what} ({how}, {len(report.get('per_prompt') or [])} prompts x up to "
        f"{report.get('max_new_tokens')} new tokens, on {report.get('device')}): tau "
        + _mean_tau(report.get("tau_prompt_mean"), " (as z-lab's benchmark.py reports)")
        + f"{report['tau']:.3f} pooled (as SpecForge's benchmarks report); output identical to the "
        f"target's greedy decode: {_yes(report.get('identical'))}"
        + (f"; prompts: {source}" if (source := prompts_text(report.get("prompts_source"), 64)) else ""),
        f"- speedup over the target alone ({what}, the same machine): {report['speedup']:.2f}x",
    ]
    free = report.get("baseline")
    if free:
        lines.append(
            "- free baseline, prompt lookup on the same decode path: tau "
            + _mean_tau(free.get("tau_prompt_mean"))
            + f"{free['tau']:.3f} pooled, speedup over the target alone {free['speedup']:.2f}x"
        )
    return lines


def _mean_tau(mean: float | None, note: str = "") -> str:
    """`2.296 mean of per-prompt tau<note>, ` before the pooled figure; empty for a report written
    before the mean was kept (it has the pooled one only)."""
    return "" if mean is None else f"{mean:.3f} mean of per-prompt tau{note}, "


def _yes(value: object) -> str:
    return {True: "yes", False: "no"}.get(value, "not compared (sampled)")  # type: ignore[arg-type]


def _hardware_lines(run: dict, export: Path) -> list[str]:
    gpus = [g for g in run.get("gpus") or [] if g != "cpu"]
    gpu_name = _export_metadata(export).get("gpu")
    if gpus:
        what = f"{len(gpus)} x {gpu_name or 'GPU (name not recorded)'}"
    else:
        what = gpu_name or "CPU"
    return [f"- trained on: {what}" + (f" (host `{run['host']}`)" if run.get("host") else "")]


def _export_metadata(export: Path) -> dict:
    try:
        return safetensors_metadata(export / "model.safetensors")
    except (OSError, ValueError, struct.error):
        return {}


def _use_lines(exported: dict, target: str) -> list[str]:
    commands = serve_commands(exported, "THIS_REPO_OR_DIR", target)
    lines = [
        "With transformers (z-lab's interface; the target's embeddings and LM head are passed in):",
        "",
        "```python",
        "from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer",
        'draft = AutoModel.from_pretrained("THIS_REPO_OR_DIR", trust_remote_code=True, dtype="auto").eval()',
        f'target = AutoModelForCausalLM.from_pretrained("{target}", dtype="auto").eval()',
        f'tokenizer = AutoTokenizer.from_pretrained("{target}")',
        'input_ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,',
        # return_dict=False: the ids, not a BatchEncoding (transformers 5)
        '                                          return_tensors="pt", return_dict=False)',
        "output = draft.spec_generate(input_ids=input_ids, max_new_tokens=256, temperature=0.0, target=target,",
        "                             stop_token_ids=[tokenizer.eos_token_id])",
        "```",
        "",
        "Serving (commands read from the engines' sources, not run by dflashctl):",
        "",
        "```bash",
        commands["vLLM"],
        commands["SGLang"],
        "```",
    ]
    return lines


def _serving_check_lines(export: Path) -> list[str]:
    """This export against what the engines' DFlash loaders read (dflashctl/serving.py)."""
    try:
        result = check_export(export)
    except (OSError, ValueError, KeyError, struct.error) as exc:
        return [f"- not checked: {exc}"]
    lines = [
        "Against the config fields and weights each loader reads (from its source, at the commit "
        "dflashctl records; the engines were not run):",
        "",
    ]
    for loader, problems in result.items():
        lines.append(f"- {loader}: " + ("meets them" if not problems else "; ".join(problems)))
    return lines
