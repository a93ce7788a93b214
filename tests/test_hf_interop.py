"""Hugging Face checkpoints in (`model.init_from`), out (`ray-zep export`) and `ray-zep eval`.

Tiny random LlamaForCausalLM / Qwen2ForCausalLM models (fp32, CPU) are saved with
`save_pretrained`; ray_zep's packed varlen forward over several documents must give
the logits transformers computes document by document, and the losses it computes
with `labels=input_ids`. fp32 on CPU: relative error at most 1e-5 (only summation
order differs).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from ray_zep.attention.varlen import PackedSeqs, positions_from_lengths
from ray_zep.cli import main
from ray_zep.config import load_config, write_resolved_config
from ray_zep.data.source import ParquetSource
from ray_zep.errors import ConfigError
from ray_zep.model import hf
from ray_zep.train.build import build_model
from ray_zep.train.restore import ModelSource, resolve_source, whole_model
from tests.helpers.placing import made_weights
from tests.helpers.procs import run_ranks
from tests.helpers.training import mixed_dataset, train_rank

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

pytestmark = pytest.mark.unit

TOLERANCE = 1e-5  # fp32 on CPU: the two forwards differ only in summation order
LENGTHS = [7, 19, 12]  # three documents of one packed batch
SIZES = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    rope_theta=500.0,
    rms_norm_eps=1e-6,
)


def tiny_hf(path: Path, arch: str = "llama", tied: bool = False):
    """A random HF model saved at `path`; weights drawn wide enough (std 0.15, norms
    around 1) that attention is far from uniform, so a wrong RoPE order shows."""
    if arch == "llama":
        config = transformers.LlamaConfig(**SIZES, tie_word_embeddings=tied)
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.Qwen2Config(**SIZES, tie_word_embeddings=tied)
        model = transformers.Qwen2ForCausalLM(config)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else 0.15 * noise)
    model = model.float().eval()
    model.save_pretrained(path)
    return model


def packed_logits(model, tokens: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    positions = torch.from_numpy(positions_from_lengths(np.array(lengths)))
    with torch.no_grad():
        return model(tokens, positions, PackedSeqs.from_lengths(lengths))


def per_document(reference, tokens: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    out, start = [], 0
    with torch.no_grad():
        for n in lengths:
            out.append(reference(tokens[start : start + n][None]).logits[0])
            start += n
    return out


def assert_close(ours: torch.Tensor, refs: list[torch.Tensor], lengths: list[int]) -> None:
    start = 0
    for doc, (n, ref) in enumerate(zip(lengths, refs, strict=True)):
        got = ours[start : start + n]
        err = float((got - ref).norm() / ref.norm())
        diff = (got - ref).abs()
        assert err <= TOLERANCE, (
            f"document {doc}: relative error {err:.2e}, max abs {float(diff.max()):.2e}, "
            f"mean abs {float(diff.mean()):.2e}"
        )
        start += n


def _tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (sum(LENGTHS),), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "arch, tied", [("llama", False), ("llama", True), ("qwen2", False)], ids=str
)
def test_trainer_model_from_checkpoint_matches_transformers(tmp_path, arch, tied) -> None:
    reference = tiny_hf(tmp_path, arch, tied)
    config = load_config(None, [f"model.init_from={tmp_path}", "parallel.sequence=single"])
    model, _ = build_model(config, torch.device("cpu"), torch.float32)
    assert model.shape.qkv_bias == (arch == "qwen2")
    assert model.shape.norm_eps == 1e-6 and model.shape.rope_theta == 500.0
    tokens = _tokens()
    assert_close(packed_logits(model, tokens, LENGTHS), per_document(reference, tokens, LENGTHS),
                 LENGTHS)  # fmt: skip


@pytest.mark.dist
@pytest.mark.parametrize(("weights", "dtype"), [("fsdp", "float32"), ("fsdp", "bfloat16"),
                                               ("replicated", "float32")])  # fmt: skip
def test_each_rank_takes_its_own_part_of_the_checkpoint(tmp_path, weights, dtype) -> None:
    """Sharded or not, a trainer's weights from `model.init_from` (each rank keeps its
    part of each tensor as it reads them, `build_model(deferred=True)`; a bf16 checkpoint
    cast to the fp32 weights first) equal the whole model loaded from the checkpoint, bit
    for bit, and a rank makes them only after FSDP2 shards them."""
    tiny_hf(tmp_path, tied=True).to(getattr(torch, dtype)).save_pretrained(tmp_path)
    overrides = [f"model.init_from={tmp_path}", f"parallel.weights={weights}",
                 "metrics.memory_every=0"]  # fmt: skip
    for events, equal, differs in run_ranks(made_weights, 2, overrides):
        assert equal, f"{differs} differs from the checkpoint's"
        sharded = "parallel.weights=fsdp" in overrides
        assert events == (["shard", "make"] if sharded else ["make"])


def test_without_the_rope_permutation_logits_differ(tmp_path, monkeypatch) -> None:
    """The check above can see a wrong row order (a negative control)."""
    reference = tiny_hf(tmp_path)
    monkeypatch.setattr(hf, "halves_to_pairs", lambda w, heads: w)
    config = load_config(None, [f"model.init_from={tmp_path}"])
    model, _ = build_model(config, torch.device("cpu"), torch.float32)
    tokens = _tokens()
    ours, refs = packed_logits(model, tokens, LENGTHS), per_document(reference, tokens, LENGTHS)
    assert float((ours[: LENGTHS[0]] - refs[0]).norm() / refs[0].norm()) > 1e-3


def test_sharded_checkpoint_loads(tmp_path) -> None:
    reference = tiny_hf(tmp_path / "one", "qwen2")
    reference.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / hf.INDEX_FILE).is_file()
    assert not (tmp_path / "sharded" / hf.SINGLE_FILE).exists()
    config = load_config(None, [f"model.init_from={tmp_path / 'sharded'}"])
    model = whole_model(ModelSource(config, None))
    tokens = _tokens(1)
    assert_close(packed_logits(model, tokens, LENGTHS), per_document(reference, tokens, LENGTHS),
                 LENGTHS)  # fmt: skip


def test_shape_keys_must_agree_with_the_checkpoint(tmp_path) -> None:
    tiny_hf(tmp_path)
    same = load_config(None, [f"model.init_from={tmp_path}", "model.dim=64", "model.n_layers=2"])
    assert same.model.init_from == str(tmp_path)
    with pytest.raises(ConfigError, match=r"model\.dim=128 conflicts with hidden_size=64"):
        load_config(None, [f"model.init_from={tmp_path}", "model.dim=128"])
    with pytest.raises(ConfigError, match=r"model\.moe\.num_experts=4"):
        load_config(None, [f"model.init_from={tmp_path}", "model.moe.num_experts=4"])


def test_bad_checkpoints_name_the_key_and_the_path(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"model\.init_from.*no config\.json"):
        load_config(None, [f"model.init_from={tmp_path / 'nowhere'}"])
    tiny_hf(tmp_path / "gpt")
    config = json.loads((tmp_path / "gpt" / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "gpt" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"model\.init_from.*gpt.*GPT2LMHeadModel"):
        load_config(None, [f"model.init_from={tmp_path / 'gpt'}"])
    tiny_hf(tmp_path / "empty")
    (tmp_path / "empty" / hf.SINGLE_FILE).unlink()
    config = load_config(None, [f"model.init_from={tmp_path / 'empty'}"])
    with pytest.raises(ConfigError, match=r"model\.init_from.*neither model\.safetensors"):
        build_model(config, torch.device("cpu"), torch.float32)
    with pytest.raises(ConfigError, match=r"model\.init_from"):
        load_config(None, ["model.init_from=' '"])


@pytest.mark.parametrize("arch, tied", [("llama", True), ("qwen2", False)], ids=str)
def test_export_round_trip_gives_transformers_the_same_logits(tmp_path, capsys, arch, tied):
    reference = tiny_hf(tmp_path / "hf", arch, tied)
    config_file = tmp_path / "run.yaml"
    config_file.write_text(f"model:\n  init_from: {tmp_path / 'hf'}\n")
    assert main(["export", str(config_file), "--out", str(tmp_path / "out")]) == 0
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    expected = "Qwen2ForCausalLM" if arch == "qwen2" else "LlamaForCausalLM"
    assert exported["architectures"] == [expected]
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    tokens = _tokens(2)
    refs = per_document(reference, tokens, LENGTHS)
    assert_close(torch.cat(per_document(again, tokens, LENGTHS)), refs, LENGTHS)


def test_trained_run_exports_what_ray_zep_computes(tmp_path) -> None:
    """Two steps from a HF checkpoint with the one-process reference, then export: HF
    reads the run's last checkpoint back with ray_zep's logits."""
    tiny_hf(tmp_path / "hf", "qwen2")
    run_dir = tmp_path / "run"
    overrides = [
        f"model.init_from={tmp_path / 'hf'}",
        "parallel.sequence=single",
        "train.steps=2",
        "train.tokens_per_rank=128",
        f"data.source={mixed_dataset(tmp_path / 'docs.parquet')}",
        f"train.out_dir={run_dir}",
        "metrics.progress=false",
        "metrics.memory_every=0",
    ]
    result = train_rank(0, 1, overrides)
    assert sorted(result["losses"]) == [1, 2]
    write_resolved_config(load_config(None, overrides), run_dir)  # as the driver does
    assert main(["export", str(run_dir), "--out", str(tmp_path / "out")]) == 0
    ours = whole_model(resolve_source(str(run_dir), []))
    trained = result["params"]["layers.0.attention.wq.bias"]
    assert torch.equal(ours.state_dict()["layers.0.attention.wq.bias"], trained)
    start = whole_model(ModelSource(load_config(None, overrides), None))
    assert not torch.equal(start.state_dict()["layers.0.attention.wq.bias"], trained)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    tokens = _tokens(3)
    refs = per_document(again, tokens, LENGTHS)
    assert_close(packed_logits(ours, tokens, LENGTHS), refs, LENGTHS)


def test_eval_gives_transformers_document_losses(tmp_path) -> None:
    reference = tiny_hf(tmp_path / "hf")
    data = mixed_dataset(tmp_path / "docs.parquet")
    config_file = tmp_path / "eval.yaml"
    config_file.write_text(
        f"model:\n  init_from: {tmp_path / 'hf'}\ndata:\n  source: {data}\n"
        "train:\n  tokens_per_rank: 64\n"
    )
    out = tmp_path / "eval.json"
    assert main(["eval", str(config_file), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    source = ParquetSource(data)
    assert [d["doc"] for d in result["documents"]] == list(range(source.num_docs))
    total, labels = 0.0, 0
    with torch.no_grad():
        for entry in result["documents"]:
            ids = torch.from_numpy(source.tokens(entry["doc"]).astype(np.int64))[None]
            assert entry["tokens"] == ids.shape[1]
            if ids.shape[1] < 2:
                assert entry["loss"] is None
                continue
            want = float(reference(ids, labels=ids).loss)
            assert abs(entry["loss"] - want) <= TOLERANCE * want, (entry, want)
            total, labels = total + want * (ids.shape[1] - 1), labels + ids.shape[1] - 1
    assert result["label_tokens"] == labels
    assert abs(result["loss"] - total / labels) <= TOLERANCE * result["loss"]
    assert main(["eval", str(config_file), "--batches", "2", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["batches"] == 2


def _damaged_copies(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Checkpoints that load_config accepts (config.json is fine) but whose weights are
    not what it promises, each with the message `ray-zep train` must end in."""
    tiny_hf(tmp_path / "good")
    good = tmp_path / "good" / hf.SINGLE_FILE
    tensors = hf.read_safetensors(good)
    cases = {}

    def copy(name: str) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text((tmp_path / "good" / "config.json").read_text())
        return folder / hf.SINGLE_FILE

    data = good.read_bytes()
    copy("truncated").write_bytes(data[: len(data) // 2])
    cases["truncated"] = "not a readable safetensors file: .*not fully covered"
    copy("garbage").write_bytes(b"\x00" * 64)
    cases["garbage"] = "not a readable safetensors file"
    missing = dict(tensors)
    del missing["model.layers.1.mlp.up_proj.weight"]
    hf.write_safetensors(missing, copy("missing"))
    cases["missing"] = r"missing \['model\.layers\.1\.mlp\.up_proj\.weight'\]"
    reshaped = {**tensors, "model.norm.weight": torch.zeros(63)}
    hf.write_safetensors(reshaped, copy("reshaped"))
    cases["reshaped"] = r"norm\.weight .* has shape \(63,\), config\.json implies \(64,\)"
    return {name: (tmp_path / name, pattern) for name, pattern in cases.items()}


def test_a_damaged_checkpoint_is_refused_in_one_line_before_any_worker_starts(
    tmp_path, capsys, monkeypatch
) -> None:
    """What each rank's load would refuse, `ray-zep train` refuses from the headers
    alone, before Ray starts: no worker tracebacks, no retries."""
    from ray_zep_workers import driver

    def no_cluster(*_args, **_kwargs):
        raise AssertionError("the driver connected to Ray for a run it should refuse")

    monkeypatch.setattr(driver, "connect", no_cluster)
    demo = str(Path(__file__).resolve().parents[1] / "conf" / "demo.yaml")
    for name, (folder, pattern) in _damaged_copies(tmp_path).items():
        out = tmp_path / f"run_{name}"
        capsys.readouterr()  # what saving and loading models printed before
        code = main(["train", demo, f"model.init_from={folder}", f"train.out_dir={out}"])
        err = capsys.readouterr().err.strip()
        assert code == 2, f"{name}: {err}"
        assert len(err.splitlines()) == 1, f"{name}: {err}"
        assert re.search(rf"^ray-zep: error: config key model\.init_from: .*{pattern}", err), err
        # every rank's own load refuses the same file the same way
        config = load_config(None, [f"model.init_from={folder}"])
        with pytest.raises(ConfigError, match=pattern):
            build_model(config, torch.device("cpu"), torch.float32)
