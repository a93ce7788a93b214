"""Settings that scenario tests pin, so that the figures their docstrings quote hold."""

WHOLE_EXCHANGES = "parallel.ulysses_chunks=1"
"""USP head exchanges whole, as the planner costed them and the simulator played them when
these scenarios' figures were taken (`parallel.ulysses_chunks` runs them in 4 pieces by
default, which changes the levels the work policy keeps and the plans it makes)."""
