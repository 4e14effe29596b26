"""The runtime every other part stands on: streams and events (`streams`), counting where the host waits for the
device (`sync_points`), the table of what the dual cache refuses (`refusals`), the optional parts and the packages
each needs (`extras`), progress bars (`progress`).

Imports: nothing else of `dual_cache` (the package order: docs/architecture.md, tests/test_import_graph.py).
"""
