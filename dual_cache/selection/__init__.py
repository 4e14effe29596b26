"""Choosing each step's entries on the host: what a selection is asked and wants resident (`candidates`), one
selector per policy (`selectors/`), Quest's pages (`quest_pages`), and the real token's re-rank on the device
(`rerank`).

Imports: `runtime`, `kernels`, `engine`, `host`, `model` (the package order: docs/architecture.md,
tests/test_import_graph.py); never `config`, which imports the selectors' registry.
"""
