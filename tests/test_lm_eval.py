"""End to end with EleutherAI's lm-evaluation-harness (`lm-eval[api]`, in a venv of its own: .venv-lm-eval/, made on
first use, skipped with a message where it cannot be installed) against `dual-decoder serve`'s app on 127.0.0.1:
a generate_until task through /v1/completions (token ids, batches of 2) and /v1/chat/completions, and a
multiple-choice (loglikelihood) task whose log-likelihoods equal the model's own. Local data only (slow). The
command lines are docs/serving.md's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import torch
from conftest import uvicorn_server

from dual_cache.serving import Scheduler
from dual_cache.serving.server import create_app

ROOT = Path(__file__).resolve().parents[1]
LM_EVAL_VENV = ROOT / ".venv-lm-eval"  # git-ignored (.venv-*/)
MC = [{"question": "What is the capital of France?", "choices": ["Paris", "London", "Tokyo"], "answer": 0},
      {"question": "How many legs does a dog have?", "choices": ["three", "ten", "four"], "answer": 2},
      {"question": "What do bees make?", "choices": ["honey", "steel", "glass"], "answer": 0}]
GEN = [{"question": "What is the capital of France?", "answer": "Paris"},
       {"question": "What is 2 + 2?", "answer": "4"}]
TASKS = {
    "dual_mc": "output_type: multiple_choice\ndoc_to_choice: \"{{choices}}\"\nmetric_list:\n  - metric: acc\n",
    "dual_gen": "output_type: generate_until\ngeneration_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 8\n"
                "  do_sample: false\nmetric_list:\n  - metric: exact_match\n    ignore_case: true\n",
}


def _lm_eval() -> Path:
    """The `lm_eval` command of a venv holding `lm-eval[api]` and transformers (its tokenizer backend), no torch."""
    command = LM_EVAL_VENV / "bin" / "lm_eval"
    if not command.exists():
        venv.create(LM_EVAL_VENV, with_pip=True)
        result = subprocess.run([str(LM_EVAL_VENV / "bin" / "python"), "-m", "pip", "install", "-q", "lm-eval[api]",
                                 "transformers>=5.22,<6"], capture_output=True, text=True, timeout=1800)
        if result.returncode or not command.exists():
            pytest.skip(f"lm-eval[api] cannot be installed here: {result.stderr.strip()[-300:]}")
    return command


@pytest.fixture(scope="module")
def setup(embedded, tmp_path_factory):
    command = _lm_eval()
    model, tokenizer = embedded
    folder = tmp_path_factory.mktemp("lm_eval")
    tokenizer.save_pretrained(folder / "tokenizer")
    for name, rows in (("dual_mc", MC), ("dual_gen", GEN)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        (folder / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / name}.jsonl\n"
            "test_split: test\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\ndoc_to_target: \"{{answer}}\"\n"
            + TASKS[name], encoding="utf-8")
    scheduler = Scheduler(model, tokenizer, cache_config={"budget": 256}, max_batch=4)
    with uvicorn_server(create_app(scheduler, tokenizer, "smollm2-135m")) as port:
        yield command, folder, f"http://127.0.0.1:{port}"


def _run(command: Path, folder: Path, model: str, model_args: str, tasks: str, *extra: str) -> dict:
    """Run lm_eval; returns `{"results": ..., "samples": {task: [rows]}}` from its output folder."""
    out = folder / f"out-{model}"
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([str(command), "--model", model, "--model_args", model_args, "--tasks", tasks,
                             "--include_path", str(folder), "--log_samples", "--output_path", str(out), *extra],
                            capture_output=True, text=True, timeout=1200, cwd=folder, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    (results,) = out.rglob("results_*.json")
    samples = {task: [json.loads(line) for path in out.rglob(f"samples_{task}_*.jsonl")
                      for line in path.read_text(encoding="utf-8").splitlines()] for task in tasks.split(",")}
    return {"results": json.loads(results.read_text(encoding="utf-8"))["results"], "samples": samples}


@pytest.mark.slow
def test_lm_eval_generate_until_and_multiple_choice_through_the_completions_endpoint(setup, embedded):
    command, folder, base = setup
    model, tokenizer = embedded
    run = _run(command, folder, "local-completions",
               f"model=smollm2-135m,base_url={base}/v1/completions,tokenizer={folder / 'tokenizer'},"
               "tokenizer_backend=huggingface,tokenized_requests=True", "dual_gen,dual_mc", "--batch_size", "2")
    assert "exact_match,none" in run["results"]["dual_gen"] and "acc,none" in run["results"]["dual_mc"]
    answers = [s["resps"][0][0] for s in run["samples"]["dual_gen"]]
    assert len(answers) == len(GEN) and all(isinstance(a, str) for a in answers) and any(answers)
    for sample in run["samples"]["dual_mc"]:
        for args, resp in zip(sample["arguments"].values(), sample["resps"]):
            context, continuation = args["arg_0"], args["arg_1"]
            whole, ctx = tokenizer(context + continuation).input_ids, tokenizer(context).input_ids
            with torch.inference_mode():
                logits = model(torch.tensor([whole])).logits[0].float()
            logprobs = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(whole[1:])[:, None])[:, 0]
            assert abs(float(resp[0][0]) - logprobs[len(ctx) - 1:].sum().item()) < 1e-3


@pytest.mark.slow
def test_lm_eval_generate_until_through_the_chat_endpoint(setup):
    command, folder, base = setup
    run = _run(command, folder, "local-chat-completions", f"model=smollm2-135m,base_url={base}/v1/chat/completions",
               "dual_gen", "--apply_chat_template")
    assert "exact_match,none" in run["results"]["dual_gen"]
    assert all(s["resps"][0][0].strip() for s in run["samples"]["dual_gen"])
