"""`dual-decoder`, the command line: `generate`, `demo` and the commands other packages register (`main`), `serve`
(`serve`), `export-generate` (`hub`), and every command's `--help` layout (`help_format`).

Imports: every package of the library (the top of the package order: docs/architecture.md,
tests/test_import_graph.py), never `dual_cache.eval`: the evaluation's commands come through the
`dual_cache.commands` entry points.
"""
