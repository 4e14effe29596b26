"""The throughput and memory benchmark (`dual-decoder bench`), its capacity search, and where a step's time goes."""
