"""Moving entries host→device: what a step copies (`delta`), a layer's device-resident entries and the host's
mirror of them (`resident_set`), and the layer-aware schedule that runs selection jobs on host threads and copies
each delta into layer-scoped device buffers in stream order (`schedule`).

Imports: `runtime`, `kernels`, `engine`, `host`, `model`, `selection`, `dual_cache.config` (the package order:
docs/architecture.md, tests/test_import_graph.py).
"""
