"""Where one lowbit `select_into` call's time goes at 32K (Llama-3.1-8B shape: 8 KV heads x 128, 32 query heads,
bf16, budget 256, one sequence, 4 distinct layers): the engine call (`dc_select`, timed by wrapping it) vs the whole
call through Python, at 1 and 2 engine threads, with the layers' data warm in the CPU caches (the same 4 layers
called in turn) and cold (256 MB written between calls, as 32 layers' indexes or exact selection's key scan would).

Run: .venv/bin/python results/bench/lowbit-call-profile/profile_call.py  (output: results.md beside it)
"""
import time, statistics, torch, ctypes
from dual_cache.eval.selection.bench_retrieval import _store
from dual_cache.config import DualDecoderConfig
from dual_cache.selectors import SELECTORS, Candidates
from dual_cache.engine import native
import dual_cache.engine as eng
ctx, B, H, Hq, D = 32768, 1, 8, 32, 128
stores = [_store(B, H, D, ctx, ctx + 64, torch.bfloat16, seed=i) for i in range(4)]
cfg = DualDecoderConfig(selector="lowbit")
sels = [SELECTORS["lowbit"](cfg, 256, s, "cpu") for s in stores]
for s in sels: s.extend(ctx, torch.zeros(B, dtype=torch.long))
q = torch.randn(B, Hq, D)
out = [[torch.empty(B, H, 256, D, dtype=torch.bfloat16) for _ in range(2)] for _ in stores]
hi = ctx - 64
cand = Candidates(torch.arange(hi)[None, :].expand(B, hi) >= 4, torch.zeros(B, dtype=torch.long))
lib = native.library()
engine_t = []
orig = lib.dc_select
class Wrap:
    def __init__(self, f): self.f = f
    def __call__(self, *a):
        t = time.perf_counter(); r = self.f(*a); engine_t.append(time.perf_counter() - t); return r
for threads in (1, 2):
    torch.set_num_threads(threads)
    tot = []
    engine_t.clear()
    w = Wrap(orig)
    native._resolved["auto"] = type("L", (), {"dc_select": w, "__getattr__": lambda self, n: getattr(lib, n)})()
    for rep in range(30):
        for i in range(4):
            t = time.perf_counter(); sels[i].select_into(q, cand, 0.088, out[i]); tot.append(time.perf_counter() - t)
    native._resolved["auto"] = lib
    print(f"threads {threads}: select_into median {statistics.median(tot[8:])*1e3:.2f} ms, engine call median {statistics.median(engine_t[8:])*1e3:.2f} ms")
flush = torch.zeros(64 * 2**20, dtype=torch.float32)  # 256 MB
for threads in (1, 2):
    torch.set_num_threads(threads)
    tot = []; engine_t.clear()
    w = Wrap(orig)
    native._resolved["auto"] = type("L", (), {"dc_select": w, "__getattr__": lambda self, n: getattr(lib, n)})()
    for rep in range(12):
        for i in range(4):
            flush.add_(1.0)
            t = time.perf_counter(); sels[i].select_into(q, cand, 0.088, out[i]); tot.append(time.perf_counter() - t)
    native._resolved["auto"] = lib
    print(f"flushed, threads {threads}: select_into median {statistics.median(tot[4:])*1e3:.2f} ms, engine call median {statistics.median(engine_t[4:])*1e3:.2f} ms")
