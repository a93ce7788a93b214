"""A small RGB raster canvas that writes PNG files (zlib only, no plotting library)."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np

from ray_zep.report.font import HEIGHT, WIDTH, glyph

Color = tuple[int, int, int]

WHITE: Color = (255, 255, 255)
BLACK: Color = (0, 0, 0)
GREY: Color = (150, 150, 150)


class Canvas:
    """Pixels (height x width x RGB) with rectangles and text; (0, 0) is the top left."""

    def __init__(self, width: int, height: int, background: Color = WHITE) -> None:
        self.pixels = np.empty((height, width, 3), dtype=np.uint8)
        self.pixels[:] = background

    @property
    def width(self) -> int:
        return self.pixels.shape[1]

    @property
    def height(self) -> int:
        return self.pixels.shape[0]

    def fill(self, x0: float, y0: float, x1: float, y1: float, color: Color) -> None:
        """Fill [x0, x1) x [y0, y1), clipped to the canvas; at least one pixel wide."""
        left, top = max(0, int(x0)), max(0, int(y0))
        right = min(self.width, max(int(x1), left + 1))
        bottom = min(self.height, max(int(y1), top + 1))
        self.pixels[top:bottom, left:right] = color

    def text(self, x: int, y: int, label: str, color: Color = BLACK, scale: int = 1) -> int:
        """Draw `label` with its top-left corner at (x, y); returns the width drawn."""
        step = (WIDTH + 1) * scale
        for index, char in enumerate(label):
            mask = np.kron(glyph(char), np.ones((scale, scale), dtype=bool))
            left = x + index * step
            region = self.pixels[y : y + HEIGHT * scale, left : left + WIDTH * scale]
            region[mask[: region.shape[0], : region.shape[1]]] = color
        return len(label) * step

    @staticmethod
    def text_width(label: str, scale: int = 1) -> int:
        return len(label) * (WIDTH + 1) * scale

    def save(self, path: str | Path) -> Path:
        """Write the canvas as an 8-bit RGB PNG."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(encode_png(self.pixels))
        return path


def encode_png(pixels: np.ndarray) -> bytes:
    """PNG bytes of a height x width x 3 uint8 array (no filtering, zlib level 6)."""
    height, width, _ = pixels.shape
    rows = np.zeros((height, 1 + width * 3), dtype=np.uint8)  # filter byte 0 per row
    rows[:, 1:] = pixels.reshape(height, width * 3)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"".join(
        [
            b"\x89PNG\r\n\x1a\n",
            _chunk(b"IHDR", header),
            _chunk(b"IDAT", zlib.compress(rows.tobytes(), 6)),
            _chunk(b"IEND", b""),
        ]
    )


def decode_png(data: bytes) -> np.ndarray:
    """Pixels of a PNG written by `encode_png` (8-bit RGB, unfiltered rows)."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG file")
    offset, idat, size = 8, b"", (0, 0)
    while offset < len(data):
        (length,) = struct.unpack(">I", data[offset : offset + 4])
        kind = data[offset + 4 : offset + 8]
        body = data[offset + 8 : offset + 8 + length]
        if zlib.crc32(kind + body) != struct.unpack(">I", data[offset + 8 + length :][:4])[0]:
            raise ValueError(f"bad CRC in {kind!r} chunk")
        if kind == b"IHDR":
            size = struct.unpack(">II", body[:8])
        elif kind == b"IDAT":
            idat += body
        offset += 12 + length
    width, height = size
    rows = np.frombuffer(zlib.decompress(idat), dtype=np.uint8).reshape(height, 1 + 3 * width)
    return rows[:, 1:].reshape(height, width, 3)


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
