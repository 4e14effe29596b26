#!/bin/bash
# Issue 27's frontier: each measured lowbit configuration (channels share, shortlist factor) timed beside exact
# selection through the engine, 32K and 128K, batch 1, two retrieval threads (one layer each), Llama-3.1-8B shape.
# Run from the repository root: bash results/bench/lowbit-frontier/run.sh
set -e
for cfg in "0.25 8" "0.375 6" "0.5 4" "0.5 6" "1.0 4"; do
  set -- $cfg
  .venv/bin/dual-decoder bench-retrieval --contexts 32768 131072 --pools 2 --selectors exact lowbit --repeats 30 \
    --options "{\"lowbit_channels\": $1, \"lowbit_factor\": $2}" \
    --out results/bench/lowbit-frontier/bench-c$1-f$2
done
.venv/bin/python results/bench/lowbit-frontier/make_frontier.py
