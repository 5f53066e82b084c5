"""SmolLM2's greedy tokens on the default path (the dtype `auto` picks, the file's int4 codes, the step COMPILE gives
for N_TOKENS new tokens as generate.py builds it: `auto`, eager for a short answer, or `blocks`, what `auto` runs for a
long one), decoded one row at a time, speculatively (prompt lookup and the int4 self-draft, k = 2 and 4) and as one
batch: one JSON object on stdout, for tests/test_greedy.py to compare, with the step's mode as it ran. A script, not a
test, because the CPU class (ATEN_CPU_CAPABILITY) is fixed when torch loads: the test runs it in a process of each
class.

    python tests/greedy_rows.py N_TOKENS COMPILE PROMPT [PROMPT ...]
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import speculative  # noqa: E402
from cli import default_model, pick_dtype  # noqa: E402
from decode import generate, generate_batch  # noqa: E402
from generate import new_tokens  # noqa: E402
from load import load_model  # noqa: E402
from sample import SamplingParams  # noqa: E402
from step import Step  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402


def main(n_tokens: int, compile_mode: str, texts: list[str]) -> dict:
    device = torch.device("cpu")
    dtype, _ = pick_dtype("auto", device)
    model, path = load_model(default_model(), device, dtype)
    draft_model, _ = load_model(path, device, dtype, quantize="int4:32")
    tokenizer = load_tokenizer(path)
    greedy, eos = SamplingParams(temperature=0), tokenizer.eos_ids
    prompts = [tokenizer.encode(t) for t in texts]
    # generate.py's steps: auto's choice made for the decode steps the command will run (the target's and the
    # draft's alike, make_draft)
    decode_steps = new_tokens(n_tokens, max(map(len, prompts)), model.args.max_seq_len)
    step = Step(model, compile_mode, decode_steps=decode_steps)
    draft_step = Step(draft_model, compile_mode, decode_steps=decode_steps)
    runs = []
    for prompt in prompts:
        plain = generate(model, prompt, max_new_tokens=n_tokens, params=greedy, stop_ids=eos, step=step)
        run = {"plain": [t.id for t in plain]}
        for k in (2, 4):
            for name, draft in (("lookup", speculative.PromptLookupDraft()),
                                ("self-draft", speculative.ModelDraft(draft_model, model, draft_step))):
                tokens = speculative.generate(model, draft, prompt, max_new_tokens=n_tokens, params=greedy,
                                              stop_ids=eos, k=k, step=step)
                run[f"{name} k={k}"] = [t.id for t in tokens]
        runs.append(run)
    rows = [[] for _ in prompts]
    for tokens in generate_batch(model, prompts, max_new_tokens=n_tokens, params=greedy, stop_ids=eos, step=step):
        for row, token in zip(rows, tokens):
            if token is not None:
                row.append(token.id)
    for run, row in zip(runs, rows):
        run["batch"] = row
    return {"capability": torch.backends.cpu.get_cpu_capability(), "dtype": str(dtype), "runs": runs,
            "modes": [step.mode, draft_step.mode]}  # after the runs: "none" too if a compile failed


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), sys.argv[2], sys.argv[3:])))
