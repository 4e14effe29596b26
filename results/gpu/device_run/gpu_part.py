import json, os, time, torch
from dual_cache.eval import gpu_check
from dual_cache.eval.bench import BenchGrid, PromptSource, llama31_8b_config, random_model, run_cell
out = os.environ["OUT"]
dev = torch.device("cuda")
t = time.time()
for c in gpu_check.check_correctness(dev, False):
    print("PASS" if c["passed"] else "FAIL", c["check"], c["detail"], flush=True)
print(f"correctness {time.time() - t:.0f}s", flush=True)
model = random_model(llama31_8b_config(), torch.bfloat16, dev)
prompts = PromptSource(None, model.config.vocab_size, dev)
rows = []
def cell(method, batch, ctx, **opts):
    grid = BenchGrid(methods=(method,), batches=(batch,), contexts=(ctx,), budgets=(256,), new_tokens=16, warmup_steps=3,
                     prefill_chunk_size=4096, dual_options=opts)
    row = run_cell(model, prompts, method, ctx, batch, 256 if method != "dense" else None, grid, model_name="llama8b-random-bf16")
    row.update(opts)
    rows.append(row)
    print(json.dumps({k: row[k] for k in ("method", "context", "batch", "ms_per_step", "decode_tokens_per_s", "device_bytes_per_request",
                      "cuda_peak_bytes_per_request", "dense_equivalent_bytes_per_request", "bytes_copied_per_step", "overlap_ratio",
                      "repaired_fraction", "error")} | opts), flush=True)
    with open(os.path.join(out, "cells.jsonl"), "w") as f:
        f.writelines(json.dumps(r, default=str) + "\n" for r in rows)
# The first H200 run (results/gpu/h200-32k.md) timed dense and dual-self (repair on/off) at batches 1, 4, 8. The next
# run adds the two-stage host selector (selector="shortlist"), which reads ~1/8 of the key bytes per step.
for method, batch, opts in [("dense", 1, {}), ("dual-self", 1, {"miss_repair": False}),
                            ("dual-shortlist", 1, {"miss_repair": False}), ("dense", 8, {}),
                            ("dual-self", 8, {"miss_repair": False}), ("dual-shortlist", 8, {"miss_repair": False})]:
    cell(method, batch, 32768, **opts)
