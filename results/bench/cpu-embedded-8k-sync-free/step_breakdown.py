"""Issue 41: where a dual decode step's time goes (embedded SmolLM2-135M, 8,176-token random prompts, batch 4,
16 new tokens, 2 threads, budget 256, the defaults otherwise). Steps are timed between the tokens a streamer
receives; the cache's counters give the host waits (selection, in the synchronous CPU path, and repairs).
Run with the code under test first on sys.path; prints one JSON line."""
import json, sys, time
import torch
torch.set_num_threads(2)
from transformers.generation.streamers import BaseStreamer
from dual_cache.models import load_model
from dual_cache import DualDecoderCache


class Clock(BaseStreamer):
    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


model, tok = load_model(None)
ids = torch.randint(100, 40000, (4, 8176), generator=torch.Generator().manual_seed(0))
cache = DualDecoderCache(model.config, budget=256)
clock = Clock()
model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False, cache=cache,
               streamer=clock)
s = cache.stats()
cache.close()
gaps = [b - a for a, b in zip(clock.times[1:], clock.times[2:])]  # times[0]: the prompt, times[1]: first token
steps = len(gaps)
print(json.dumps({"code": sys.argv[1], "steps": steps, "ms_per_step": 1000 * sum(gaps) / steps,
                  "ms_per_step_each": [round(1000 * g, 1) for g in gaps],
                  "wait_ms_per_step": 1000 * s["wait_seconds"] / steps,
                  "repair_ms_per_step": 1000 * s["repair_seconds"] / steps,
                  "other_ms_per_step": 1000 * (sum(gaps) - s["wait_seconds"]) / steps,
                  "stats": {k: s.get(k) for k in ("steps", "wait_seconds", "repair_seconds", "retrieval_seconds",
                                                  "repairs", "repaired_steps", "spec_hit_rate", "drift_repairs")}}))
