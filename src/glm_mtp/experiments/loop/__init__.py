"""The speculative loop and what it measures: verification, stop rules, statistics, the speedup model."""
