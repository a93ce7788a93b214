"""Benchmarks behind `ray-zep bench`: each prints a table and writes JSON and PNG."""
