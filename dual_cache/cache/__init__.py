"""`DualDecoderCache`, transformers' `Cache` API and the request lifecycle (`cache`), and one module per job around
it: its layers (`layers`), its accounting (`stats`), the checks made before any work (`checks`), a request's
host-memory plan (`host_admission`), and a new cache from sequences of other caches (`regroup`).

Imports: everything below it, up to `layer` (the package order: docs/architecture.md, tests/test_import_graph.py);
never `generate`, `serving` or `cli`.
"""
