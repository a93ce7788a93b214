"""ray_zep: LLM training for data that mixes short and very long sequences.

The library is pure PyTorch plus algorithms and never imports Ray; the Ray
layer lives in the sibling `workers/` folder, installed as `ray_zep_workers`.
"""

__version__ = "0.1.0"
