"""z-lab's transformers quick start (their README) on an export, as a user runs it: only torch
and transformers; importing dflash_train or dflashctl fails here, so the export's own files must
do everything. Run by test_speculate.py as `python -I zlab_quickstart.py TARGET EXPORT JOB OUT`:
JOB is a JSON {"prompts": [[ids]], "max_new_tokens": n, "runs": [{spec_generate's keyword
arguments: stop_token_ids, temperature, top_p, top_k}]}; OUT gets per run and prompt the new
tokens of `spec_generate`, of the target's greedy `generate` (stopping at the run's stop
tokens), and the number of verify steps (target calls after the prefill)."""

import importlib.abc
import json
import sys


class RefuseProject(importlib.abc.MetaPathFinder):
    """Any import of the project's packages fails."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("dflash_train", "dflashctl"):
            raise ImportError(f"{name}: the quick start must not need the project")
        return None


sys.meta_path.insert(0, RefuseProject())

import torch  # noqa: E402
from transformers import AutoModel, AutoModelForCausalLM  # noqa: E402


def main() -> None:
    """Load both models z-lab's way, decode every prompt both ways, write the results."""
    target_dir, draft_dir, job_file, out_file = sys.argv[1:5]
    job = json.loads(open(job_file).read())
    draft = AutoModel.from_pretrained(draft_dir, trust_remote_code=True, dtype="auto").eval()
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype="auto").eval()
    calls = []
    target.register_forward_hook(lambda module, args, output: calls.append(1))
    n, results = job["max_new_tokens"], []
    for run in job["runs"]:
        results.append([])
        for prompt in job["prompts"]:
            input_ids = torch.tensor([prompt])
            calls.clear()
            output = draft.spec_generate(input_ids=input_ids, max_new_tokens=n, target=target, **run)
            steps = len(calls) - 1
            greedy = target.generate(
                input_ids, max_new_tokens=n, do_sample=False, eos_token_id=run["stop_token_ids"], pad_token_id=0
            )
            results[-1].append(
                {
                    "spec": output[0, len(prompt) :].tolist(),
                    "greedy": greedy[0, len(prompt) :].tolist(),
                    "steps": steps,
                    "prompt_kept": output[0, : len(prompt)].tolist() == prompt,
                }
            )
    attributes = {
        "block_size": draft.block_size,
        "mask_token_id": draft.mask_token_id,
        "target_layer_ids": draft.target_layer_ids,
    }
    open(out_file, "w").write(json.dumps({"results": results, "attributes": attributes}))


if __name__ == "__main__":
    main()
