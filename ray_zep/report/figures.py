"""One way to make a picture: a matplotlib figure drawn by a callback, saved as PNG.

matplotlib is optional (`pip install 'ray-zep[plots]'`) and imported only here, when
a picture is drawn, so the base install runs every command; without it a picture is
skipped with one log line that says how to get it. Figures are built with the
object-oriented API on an Agg canvas rather than through pyplot: a library must not
switch the backend of the process that imports it (a notebook, a Ray worker), and
figures that pyplot never sees need no global bookkeeping to close.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

DPI = 110
"""Dots per inch of every saved PNG: a 10 x 4 inch figure is 1100 x 440 pixels."""
INSTALL_HINT = "pip install 'ray-zep[plots]'"

Draw = Callable[[Any, Any], None]
"""draw(figure, axes): fills a matplotlib Figure whose axes are a 2-D numpy array."""


def skip_message(what: str) -> str:
    """The one line that says `what` (pictures) was not drawn, and how to get it."""
    return f"skipped {what}: matplotlib is not installed ({INSTALL_HINT})"


def have_matplotlib() -> bool:
    """Whether matplotlib can be imported (it is an optional dependency)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def save_figure(
    path: str | Path,
    draw: Draw,
    *,
    size: tuple[float, float] = (10.0, 4.0),
    rows: int = 1,
    cols: int = 1,
    **subplots: Any,
) -> Path | None:
    """Create a figure of rows x cols axes, let `draw` fill it, save it as PNG at `path`.

    Args:
        path: the PNG to write; missing parent folders are created.
        draw: fills the figure; called with the Figure and a rows x cols array of Axes.
        size: figure size in inches (width, height); pixels are inches x DPI.
        rows, cols: the grid of axes.
        subplots: passed on to `Figure.subplots` (sharex, gridspec_kw, ...).

    Returns:
        `path` as a Path, or None when matplotlib is not installed (logged as a
        warning naming the picture and the install command).
    """
    if not have_matplotlib():
        log.warning(skip_message(f"picture {path}"))
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(figure)
    try:
        draw(figure, figure.subplots(rows, cols, squeeze=False, **subplots))
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(out, dpi=DPI, format="png")
    finally:
        figure.clear()
    return out
