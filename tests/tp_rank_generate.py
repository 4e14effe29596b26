"""One rank of tests/test_tensor_parallel.py's generate() run: launched with `torchrun --nproc-per-node N`, loads the
test's model folder with transformers' tensor parallelism (gloo on CPU) and writes what each case gave to
`OUT/rank{R}.json` (tokens, logits, cache stats). Not a test module (pytest collects `test_*.py` only).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/tp_rank_generate.py SPEC.json OUT
"""

from __future__ import annotations

import json
import os
import sys

import torch


def main(spec_path: str, out: str) -> int:
    torch.set_num_threads(1)  # N ranks share the test machine's cores
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import dual_cache
    from dual_cache.model.tensor_parallel import load_kwargs

    with open(spec_path, encoding="utf-8") as handle:
        spec = json.load(handle)
    world = int(os.environ["WORLD_SIZE"])
    result = {"cases": {}}
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32, **load_kwargs(world)).eval()
    rank = dist.get_rank()
    ids = torch.tensor(spec["input_ids"])
    mask = torch.tensor(spec["attention_mask"])
    for name, cache_config in spec["cases"].items():
        kwargs = {} if cache_config is None else {"cache": dual_cache.DualDecoderCache(model.config, **cache_config)}
        output = model.generate(ids, attention_mask=mask, max_new_tokens=spec["max_new_tokens"], do_sample=False,
                             return_dict_in_generate=True, output_logits=True, **kwargs)
        row = {"tokens": output.sequences[:, ids.shape[1]:].tolist(),
               "logits": torch.stack(output.logits, dim=1).tolist()}
        if kwargs:
            row["stats"] = kwargs["cache"].stats()
            kwargs["cache"].close()
        result["cases"][name] = row
    if spec.get("uneven"):  # a model whose KV heads the ranks cannot split: refused before any work
        uneven = AutoModelForCausalLM.from_pretrained(spec["uneven"], dtype=torch.float32, **load_kwargs(world))
        cache = dual_cache.DualDecoderCache(uneven.config, budget=64)
        try:
            uneven.generate(ids[:1], max_new_tokens=2, do_sample=False, cache=cache)
            result["uneven"] = {"error": None}
        except ValueError as error:
            result["uneven"] = {"error": str(error), "requests": cache.stats()["requests"]}
        cache.close()
    with open(os.path.join(out, f"rank{rank}.json"), "w", encoding="utf-8") as handle:
        json.dump(result, handle)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
