"""Full-budget dual cache vs the default cache (sdpa and eager), greedy, six-layer tiny random-weight Llama.

Counts the prompts (seeds 0..N-1, 300 tokens) whose 40 new tokens differ between two paths, for one dtype.
Run from the repository root (one table row per run):
    PYTHONPATH=. .venv/bin/python results/dtype/full_budget_dtypes.py float32 20
    PYTHONPATH=. .venv/bin/python results/dtype/full_budget_dtypes.py bfloat16 10
"""

import sys

import torch

import dual_cache  # noqa: F401
from tests.conftest import six_layer_llama

dtype, seeds, new = getattr(torch, sys.argv[1]), range(int(sys.argv[2])), 40
differ = {"sdpa-eager": 0, "dual-sdpa": 0, "dual-eager": 0}
for seed in seeds:
    model = six_layer_llama(seed).to(dtype)
    ids = torch.randint(3, 96, (1, 300), generator=torch.Generator().manual_seed(1000 + seed))
    out = {}
    for impl in ("sdpa", "eager"):
        model.set_attn_implementation(impl)
        out[impl] = model.generate(ids, max_new_tokens=new, do_sample=False)
    model.set_attn_implementation("sdpa")
    out["dual"] = model.generate(ids, max_new_tokens=new, do_sample=False, cache_implementation="dual",
                                 cache_config={"budget": 4096, "window": 16})
    for pair in differ:
        a, b = pair.split("-")
        differ[pair] += not torch.equal(out[a], out[b])
print(f"| {sys.argv[1]} | " + " | ".join(f"{v}/{len(seeds)}" for v in differ.values()) + " |")
