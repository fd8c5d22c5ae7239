"""Benchmarks (SPEC 11): each is one command that prints a table, writes JSON to
`e2e/bench/results/` and keeps its section of `docs/benchmarks.md` current.

Every figure is a ratio against a baseline measured in the same run.
"""
