"""Dual decoding through `generate()`: `cache_implementation="dual"` registered and routed (`integration`), the loop
(`decoding`), the dual-token step shared with the serving batch (`step`), the speculated token's proposals
(`speculators`), logits to tokens (`sampling`), a streamer's token times (`timing`).

Imports: everything below it, up to `cache` (the package order: docs/architecture.md, tests/test_import_graph.py);
never `serving` or `cli`.
"""
