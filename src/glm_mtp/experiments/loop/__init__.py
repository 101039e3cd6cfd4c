"""The speculative loop's parts: ``grammar_verify`` masks the target's verification with a
grammar's matcher (DESIGN.md §10)."""
