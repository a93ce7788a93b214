"""ZipCCL: lossless compressed collectives (codec, zipped collectives, adaptive switcher)."""

from ray_zep.collectives.codec import Compressed, compress, decompress

__all__ = ["Compressed", "compress", "decompress"]
