"""Parallelism as composable axes (see `axes`)."""
