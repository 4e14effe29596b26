"""The model side: which layers the cache serves as full attention (`layer_types`), the KV heads a rank sees under
tensor parallelism (`tensor_parallel`), each dual forward's model inputs as transformers builds them (`inputs`),
model loading (`loading`), prompts (`chat`, `needle_prompt`).

Imports: `runtime` and `kernels` only (the package order: docs/architecture.md, tests/test_import_graph.py).
"""
