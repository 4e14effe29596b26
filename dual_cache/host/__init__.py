"""Host memory: one layer's K/V in chunks of tokens (`store`), how a store's capacity grows (`growth`), host tensors
allocated and page-locked for the device (`pages`), a cache's allowance and the process-wide count of live host
bytes (`memory`).

Imports: `runtime` and `kernels` only (the package order: docs/architecture.md, tests/test_import_graph.py).
"""
