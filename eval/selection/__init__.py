"""Host selection on its own: cost per decode step by selector, and recall of the exact top-k mass on real keys."""
