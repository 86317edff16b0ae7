"""Benchmarks behind ``knitdata bench <name>``: each prints a table, writes JSON and (optionally) a plot."""
