"""Read back the PNGs the library draws, and check that matplotlib drew them."""

from __future__ import annotations

from pathlib import Path

import numpy as np

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def read_png(path: Path) -> np.ndarray:
    """Pixels of a matplotlib-drawn PNG as height x width x RGB uint8 (alpha dropped)."""
    from matplotlib.image import imread

    assert_matplotlib_png(path)
    pixels = imread(path)  # floats in [0, 1], exact multiples of 1/255 for 8-bit PNGs
    return np.rint(pixels[..., :3] * 255).astype(np.uint8)


def assert_matplotlib_png(path: Path, min_bytes: int = 5_000) -> None:
    """`path` is a PNG that matplotlib wrote (its Software text chunk) with some content."""
    data = Path(path).read_bytes()
    assert data.startswith(PNG_SIGNATURE), f"{path} is not a PNG"
    assert b"Matplotlib" in data[: data.index(b"IDAT")], f"{path} was not drawn by matplotlib"
    assert len(data) > min_bytes, f"{path}: {len(data)} bytes, expected a real picture"
