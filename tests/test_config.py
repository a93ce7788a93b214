"""Config schema, merging, errors and the public key contract."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from ray_zep.config import (
    Compression,
    Config,
    Packing,
    config_from_dict,
    config_to_dict,
    load_config,
    renamed_overrides,
    write_resolved_config,
)
from ray_zep.errors import ConfigError
from ray_zep.parallel.axes import Placement, WeightsMode

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
PUBLIC_KEYS = [
    "train.steps",
    "train.seed",
    "train.out_dir",
    "train.tokens_per_rank",
    "parallel.sequence",
    "parallel.weights",
    "topology.preset",
    "topology.nodes",
    "topology.gpus_per_node",
    "model.preset",
    "data.source",
]


def test_defaults_are_valid_and_consistent() -> None:
    config = load_config()
    assert config == Config()
    assert config.parallel.sequence is Placement.WHOLE
    assert config.parallel.weights is WeightsMode.REPLICATED
    assert config.data.packing is Packing.RANK


def test_yaml_then_overrides_merge_in_order(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  steps: 7\n  seed: 3\nparallel:\n  sequence: single\n")
    config = load_config(path, ["train.steps=9", "topology.nodes=2"])
    assert (config.train.steps, config.train.seed) == (9, 3)
    assert config.parallel.sequence is Placement.SINGLE
    assert config.topology.nodes == 2


@pytest.mark.parametrize("key", PUBLIC_KEYS)
def test_public_contract_keys_exist(key: str) -> None:
    section, name = key.split(".")
    assert hasattr(getattr(Config(), section), name)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.stesp=3"], r"unknown config key 'train.stesp'; train takes: steps, seed"),
        (["trian.steps=3"], r"unknown config key 'trian'; the top level takes: train"),
        (["train.steps=three"], r"config key train.steps: Value 'three'.*Integer"),
        (["train.steps=1.5"], r"config key train.steps: .*Integer"),
        (["parallel.sequence=ring"], r"config key parallel.sequence: .*expected single \| whole"),
        (["parallel.weights=zero3"], r"parallel.weights: .*expected replicated \| fsdp \| hsdp"),
        (["data.overlong=trim"], r"data.overlong: .*expected split \| drop \| error"),
        (["train.steps=0"], r"train.steps=0: must be >= 1"),
        (["train.tokens_per_rank=1"], r"train.tokens_per_rank=1: must be >= 2"),
        (["topology.nodes=0"], r"topology.nodes=0: must be >= 1"),
        (["data.packing=budget"], r"parallel.sequence=whole .* needs data.packing=rank"),
        (["metrics.port=70000"], r"metrics.port=70000"),
        (["train.steps"], r"override 'train.steps' must look like key=value"),
        (["train.checkpoint_blocks=-1"], r"train.checkpoint_blocks=-1: must be >= 0"),
        (["train.checkpoint_blocks=2"], r"train.checkpoint_blocks=2: .*activation_checkpointing"),
        (
            ["train.activation_checkpointing=full", "train.checkpoint_blocks=99"],
            r"train.checkpoint_blocks=99: the model has \d+ blocks",
        ),
        (
            [
                "train.activation_checkpointing=selective",
                "train.checkpoint_blocks=1",
                "train.checkpoint_rest=selective",
            ],
            r"train.checkpoint_rest=selective: only selective, beneath .*=full",
        ),
        (
            ["train.activation_checkpointing=full", "train.checkpoint_rest=selective"],
            r"train.checkpoint_rest=selective: .*\(1 or more\) blocks",
        ),
    ],
)
def test_bad_config_is_a_one_line_error_naming_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        load_config(None, overrides)
    assert "\n" not in str(info.value)


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(broken)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(scalar)
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("model:\n  layers: 3\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'model\.layers'"):
        load_config(unknown)


def test_resolved_config_round_trips(tmp_path: Path) -> None:
    config = load_config(REPO / "conf" / "demo.yaml", ["train.steps=5", "parallel.remap=false"])
    written = write_resolved_config(config, tmp_path / "run")
    assert load_config(written) == config
    assert config_from_dict(config_to_dict(config)) == config
    assert "sequence: zeppelin" in written.read_text() and "remap: false" in written.read_text()


def test_demo_config_is_the_documented_cpu_demo() -> None:
    config = load_config(REPO / "conf" / "demo.yaml")
    assert config.model.preset == "tiny"
    assert config.topology.nodes * (config.topology.gpus_per_node or 1) == 4
    assert config.data.source == "stdlib"
    # the product: Zeppelin's placement with FSDP2, routing and remapping
    assert config.parallel.sequence.value == "zeppelin"
    assert config.parallel.weights.value == "fsdp"
    assert config.parallel.routing and config.parallel.remap


def test_a_preset_on_the_command_line_replaces_the_sizes_a_file_pins() -> None:
    """One rule for every command: the later word wins, and both words on the command
    line must agree (the preset's check names the key to drop)."""
    demo = REPO / "conf" / "demo.yaml"  # pins gpus_per_node: 2
    config = load_config(demo, ["topology.preset=cluster_a"])
    assert config.topology.gpus_per_node is None and config.topology.nodes == 2
    kept = load_config(demo, ["topology.preset=cluster_a", "topology.gpus_per_node=8"])
    assert kept.topology.gpus_per_node == 8
    assert load_config(demo).topology.gpus_per_node == 2


def test_yaml_boolean_words_name_enum_members(tmp_path: Path) -> None:
    """YAML reads an unquoted `off` as false; `comm.compression: off` still means off."""
    path = tmp_path / "run.yaml"
    path.write_text("comm:\n  compression: off\n")
    assert load_config(path).comm.compression is Compression.OFF
    on_then_off = load_config(path, ["comm.compression=always", "comm.compression=off"])
    assert on_then_off.comm.compression is Compression.OFF
    assert load_config(None, ["train.sample_ledger=off"]).train.sample_ledger is False
    with pytest.raises(ConfigError, match=r"comm\.compression.*expected off \| auto \| always"):
        load_config(None, ["comm.compression=on"])


def test_enum_words_reach_omegaconf_as_members(tmp_path: Path) -> None:
    """omegaconf before 2.4 takes an enum's member names alone (FSDP), not the values the
    configs write (fsdp): the loader hands it members, from YAML, overrides and saved
    dicts alike, so every omegaconf the package allows reads them."""
    from ray_zep.config import loader

    path = tmp_path / "run.yaml"
    path.write_text("parallel:\n  weights: fsdp\ncomm:\n  compression: off\n")
    layer = loader._load_yaml(path)
    assert layer.parallel.weights is WeightsMode.FSDP
    assert layer.comm.compression is Compression.OFF
    words = {"parallel": {"weights": "hsdp", "sequence": "nothing"}, "train": {"steps": 3}}
    members = loader._enum_members(words, Config)
    assert members["parallel"]["weights"] is WeightsMode.HSDP
    assert members["parallel"]["sequence"] == "nothing"  # left for omegaconf's error
    assert members["train"]["steps"] == 3
    config = load_config(None, ["parallel.weights=fsdp"])
    assert config_from_dict(config_to_dict(config)) == config


def test_experts_sharded_over_their_replicas_need_torch_2_12(monkeypatch) -> None:
    """Before torch 2.12 (no per-parameter FSDP mesh) experts sharded over their replicas
    are refused when the config loads, naming the keys and the torch found; versions are
    read from the installed metadata, not by importing torch."""
    from ray_zep.config import checks

    expert_sharded = ["model.preset=tiny_moe", "parallel.ep=2", "parallel.weights=fsdp",
                      "topology.nodes=1", "topology.gpus_per_node=4"]  # fmt: skip
    found = {"version": "2.11.0+cu130"}
    monkeypatch.setattr(checks.metadata, "version", lambda name: found["version"])
    with pytest.raises(ConfigError, match=r"parallel\.ep=2 with parallel\.weights=fsdp.*2\.11"):
        load_config(None, expert_sharded)
    replicated = expert_sharded[:2] + expert_sharded[3:]  # no mesh needed
    load_config(None, replicated)
    for newer in ("2.12.0", "2.13.0+cpu", "3.0.0a0+git1234"):
        found["version"] = newer
        assert load_config(None, expert_sharded).parallel.ep == 2


@pytest.mark.parametrize(
    ("where", "value", "replacement"),
    [
        ("override", "dp", "parallel.sequence=whole parallel.weights=replicated"),
        ("override", "tawpipe", "parallel.sequence=whole parallel.weights=tawpipe"),
        ("override", "weipipe", "parallel.sequence=whole parallel.weights=ring_relay"),
        ("yaml", "zeppelin", "parallel.sequence=zeppelin parallel.weights=replicated"),
    ],
)
def test_the_former_strategy_key_names_the_keys_that_replace_it(
    tmp_path: Path, where: str, value: str, replacement: str
) -> None:
    path, overrides = None, [f"parallel.strategy={value}"]
    if where == "yaml":
        path, overrides = tmp_path / "old.yaml", []
        path.write_text(f"parallel:\n  strategy: {value}\n")
    with pytest.raises(ConfigError, match=r"parallel\.strategy=.* was replaced by") as info:
        load_config(path, overrides)
    assert replacement in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("where", ["override", "yaml"])
def test_the_former_weipipe_mode_is_refused_with_its_new_name(tmp_path: Path, where: str) -> None:
    path, overrides = None, ["parallel.weights=weipipe"]
    if where == "yaml":
        path, overrides = tmp_path / "old.yaml", []
        path.write_text("parallel:\n  weights: weipipe\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    message = str(info.value)
    assert message.startswith("config key parallel.weights=weipipe was renamed: use ")
    assert "parallel.weights=ring_relay" in message
    assert "not WeiPipe's staggered schedule" in message and "\n" not in message
    assert str(pickle.loads(pickle.dumps(info.value))) == message
    config = load_config(path, [f"parallel.weights={WeightsMode.RING_RELAY.value}"])
    assert config.parallel.weights is WeightsMode.RING_RELAY, "the command line is the later word"


def test_a_saved_run_config_with_the_former_name_reads_as_ring_relay(tmp_path: Path) -> None:
    written = write_resolved_config(load_config(None, ["parallel.weights=ring_relay"]), tmp_path)
    old = written.read_text().replace("weights: ring_relay", "weights: weipipe")
    assert old != written.read_text()
    written.write_text(old)
    with pytest.raises(ConfigError, match="was renamed"):
        load_config(written)
    renamed = renamed_overrides(written)
    assert renamed == ["parallel.weights=ring_relay"]
    assert load_config(written, renamed).parallel.weights is WeightsMode.RING_RELAY
    assert renamed_overrides(tmp_path / "missing.yaml") == []


def test_each_load_starts_from_the_defaults() -> None:
    """The typed defaults are built once per process; no load (nor a change to what a load
    returned) reaches the next."""
    changed = load_config(None, ["train.steps=7", "topology.nodes=3"])
    changed.train.steps = 9
    fresh = load_config(None)
    assert (fresh.train.steps, fresh.topology.nodes) == (
        Config().train.steps,
        Config().topology.nodes,
    )
    assert load_config(None, ["train.steps=7"]).train.steps == 7
