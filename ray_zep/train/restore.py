"""The whole model of a run or of a Hugging Face checkpoint, in one process.

`ray-zep export` and `ray-zep eval` read a model without a process group:
from a run directory's newest complete checkpoint (whatever weights mode wrote
it: every mode stores parameters under their whole-model names, see
`ray_zep.train.checkpoint`) or from `model.init_from`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ray_zep import constants
from ray_zep.config import Config, load_config, renamed_overrides
from ray_zep.errors import ConfigError
from ray_zep.hf_config import read_hf_config
from ray_zep.model.hf import export_hf, load_hf_weights
from ray_zep.model.llama import Transformer
from ray_zep.model_shapes import build_shape
from ray_zep.train import checkpoint, checkpoint_dirs


@dataclass(frozen=True)
class ModelSource:
    """Where a command takes its model from.

    Attributes:
        config: the config (a run directory's resolved one, or the given file's).
        checkpoint: the checkpoint to read, or None for `model.init_from`.
    """

    config: Config
    checkpoint: Path | None


def run_source(run_dir: str | Path, config: Config) -> ModelSource:
    """The newest complete checkpoint of `run_dir`, read with `config`'s model.

    Raises:
        ConfigError: `run_dir` holds no complete checkpoint.
    """
    found = checkpoint_dirs.latest_checkpoint(Path(run_dir))
    if found is None:
        raise ConfigError(
            f"run directory {str(run_dir)!r} holds no complete checkpoint "
            f"({constants.CHECKPOINT_DIR_NAME}/step_*/ with a COMPLETE marker)"
        )
    return ModelSource(config, found)


def resolve_source(target: str, overrides: list[str], run_dir: str | None = None) -> ModelSource:
    """`RUN_DIR` (its config.yaml and last checkpoint) or `CONFIG` (its
    `model.init_from`, or `run_dir`'s last checkpoint when given).

    Raises:
        ConfigError: no config.yaml in a run directory, no checkpoint, or a
            config without `model.init_from` and no run directory.
    """
    if Path(target).is_dir():
        resolved = Path(target) / constants.RESOLVED_CONFIG_FILE_NAME
        if not resolved.is_file():
            raise ConfigError(f"{target!r} is a folder without {resolved.name}: not a run dir")
        return run_source(target, load_config(resolved, [*renamed_overrides(resolved), *overrides]))
    config = load_config(target, overrides)
    if run_dir is not None:
        return run_source(run_dir, config)
    if not config.model.init_from:
        raise ConfigError(
            f"config {target!r} sets no model.init_from: give model.init_from=DIR, or a run "
            "directory whose checkpoint to read"
        )
    return ModelSource(config, None)


def whole_model(source: ModelSource) -> Transformer:
    """The source's model on the CPU in float32, in eval mode.

    Raises:
        ConfigError / CheckpointError: unreadable checkpoint, or one whose
            experts were split by expert parallelism (stored per shard).
    """
    model = Transformer(build_shape(source.config.model))
    if source.checkpoint is None:
        load_hf_weights(model, source.config.model.init_from)
        return model.eval()
    marker_ep = _checkpoint_ep(source.checkpoint)
    if marker_ep != 1:
        raise ConfigError(
            f"checkpoint {source.checkpoint} was saved with parallel.ep={marker_ep}: its "
            "experts are stored per shard; only whole-model checkpoints (parallel.ep=1) are read"
        )
    state = checkpoint.read_model_state(source.checkpoint, model)
    model.load_state_dict(state)
    return model.eval()


def _checkpoint_ep(path: Path) -> int:
    marker = path / constants.CHECKPOINT_COMPLETE_MARKER
    return int(json.loads(marker.read_text()).get("ep", 1))


def export_model(source: ModelSource, out: str | Path) -> Path:
    """Write the source's model as a Hugging Face checkpoint into `out`."""
    model = whole_model(source)
    init_from = source.config.model.init_from
    base = read_hf_config(init_from) if init_from else None
    with torch.no_grad():
        return export_hf(model.state_dict(), model.shape, out, base)
