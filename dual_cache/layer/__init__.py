"""One full-attention layer and the dual attention call: `DualLayer`, its host store and device tiers (`layer`), the
attention function transformers calls (`attention`), what one forward hands every layer (`call`), the per-call
routing of a model's attention (`routing`), which rows a step re-selects (`repair`), and which positions are real
(`sequences`).

Imports: everything below it: `runtime`, `kernels`, `engine`, `host`, `model`, `selection`, `dual_cache.config`,
`transfer` (the package order: docs/architecture.md, tests/test_import_graph.py).
"""
