"""Record real keys/queries once per (model, tokens, seed) into rec-*.pt"""
import sys, argparse, torch
from dual_cache.eval.selection.selection_recall import add_recording_arguments, recorded_layers, check_recording_arguments
p = argparse.ArgumentParser(); add_recording_arguments(p); a = p.parse_args(sys.argv[1:])
seeds = check_recording_arguments(a)
name = (a.model or "smollm2")
for seed in seeds:
    a.seeds = str(seed)
    out = {}
    for layer, q, k, s in recorded_layers(a, [seed]):
        out[layer] = (q.half(), k.half(), s)
    torch.save(out, f"rec-{name}-{a.tokens}-{seed}.pt")
