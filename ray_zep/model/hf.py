"""Hugging Face checkpoints in and out: LlamaForCausalLM and Qwen2ForCausalLM.

`load_hf_weights` fills a `Transformer` from a checkpoint directory
(`model.init_from`); `export_hf` writes a model's weights as one (`ray-zep
export`). The shape comes from config.json through `ray_zep.hf_config`.

Names. HF's `model.embed_tokens`, `model.layers.<i>.self_attn.{q,k,v,o}_proj`,
`mlp.{gate,up,down}_proj`, `input_layernorm`, `post_attention_layernorm`,
`model.norm` and `lm_head` are our `tok_embeddings`, `layers.<i>.attention.w{q,k,v,o}`,
`feed_forward.w{1,3,2}`, `attention_norm`, `ffn_norm`, `norm` and `output`.

RoPE layout. Our `apply_rope` rotates consecutive pairs of a head's E channels,
(x[2i], x[2i+1]) by angle p·θ_i, as Meta's LLaMA does; HF Llama and Qwen2 rotate
the two halves, (x[i], x[i + E/2]) by the same angle. Both use θ_i =
base^(-2i/E). Reordering the rows of the query and key projections (and of
Qwen2's query and key biases) head by head turns one layout into the other:
HF's row h·E/2 + i (h in {0, 1}, i < E/2) is our row 2i + h. As a tensor move,
rows viewed as (heads, 2, E/2) are transposed to (heads, E/2, 2)
(`halves_to_pairs`); export applies the inverse (`pairs_to_halves`, the
permutation HF's own LLaMA conversion script applies to Meta weights). Scores
q·k are sums over channels, unchanged when q and k are reordered alike; values
and the output projection keep their order.

Tied embeddings. A checkpoint with `tie_word_embeddings` is loaded untied: the
output projection starts as a copy of the embedding and trains apart from it.
Every weights mode (FSDP2 units, weight-passing shards) cuts the embedding and
the output into different pieces, so one shared tensor would not survive them;
export therefore writes `tie_word_embeddings: false` with an `lm_head`.

Files are safetensors, read and written with the safetensors library (the `hf`
extra). Export writes float32.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ray_zep.errors import ConfigError
from ray_zep.hf_config import INIT_KEY, architecture, read_hf_config, tied
from ray_zep.model_shapes import ModelShape

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

BLOCK_NAMES = {
    "self_attn.q_proj": "attention.wq",
    "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.up_proj": "feed_forward.w3",
    "mlp.down_proj": "feed_forward.w2",
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
}
"""HF module -> ours, inside block i."""

TOP_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}

CARRIED_KEYS = ("max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")
"""config.json entries an export copies from the checkpoint the model came from."""

DEFAULT_MAX_POSITIONS = 4096


def halves_to_pairs(w: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's rotate-half row order of a q/k projection (or bias) to ours (pairs)."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, 2, half, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def pairs_to_halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of `halves_to_pairs`: our row order to HF's."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _name_map(shape: ModelShape) -> dict[str, str]:
    """HF tensor name -> our state-dict name, for every tensor of the shape."""
    names = dict(TOP_NAMES)
    kinds = ["weight"]
    for i in range(shape.n_layers):
        for hf, ours in BLOCK_NAMES.items():
            biased = shape.qkv_bias and hf in ("self_attn.q_proj", "self_attn.k_proj",
                                               "self_attn.v_proj")  # fmt: skip
            for kind in [*kinds, "bias"] if biased else kinds:
                names[f"model.layers.{i}.{hf}.{kind}"] = f"layers.{i}.{ours}.{kind}"
    return names


def _rope_heads(name: str, shape: ModelShape) -> int | None:
    """Heads whose rows `name` orders by RoPE pairs (q and k), else None."""
    if ".attention.wq." in name:
        return shape.n_heads
    if ".attention.wk." in name:
        return shape.n_kv_heads
    return None


def hf_to_ours(tensors: dict[str, torch.Tensor], shape: ModelShape, tie: bool, where: str):
    """A HF state dict as ours (names, RoPE row order, an untied output).

    Raises:
        ConfigError: a tensor is missing, unexpected or of the wrong shape.
    """
    names = _name_map(shape)
    if tie:
        tensors = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
        tensors["lm_head.weight"] = tensors.get("model.embed_tokens.weight")
    missing = sorted(k for k in names if tensors.get(k) is None)
    extra = sorted(k for k in tensors if k not in names and not k.endswith("rotary_emb.inv_freq"))
    if missing or extra:
        raise ConfigError(
            f"config key {INIT_KEY}: {where} does not match its config.json: missing "
            f"{missing[:3] or 'none'}, unexpected {extra[:3] or 'none'}"
        )
    out = {}
    for hf, ours in names.items():
        heads = _rope_heads(ours, shape)
        tensor = tensors[hf]
        out[ours] = halves_to_pairs(tensor, heads) if heads else tensor
    return out


def ours_to_hf(state: dict[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    """Our state dict as HF's (names, rotate-half row order), float32, contiguous."""
    out = {}
    for hf, ours in _name_map(shape).items():
        heads = _rope_heads(ours, shape)
        tensor = state[ours].detach().to("cpu", torch.float32)
        out[hf] = (pairs_to_halves(tensor, heads) if heads else tensor).contiguous()
    return out


def load_hf_weights(model: torch.nn.Module, directory: str | Path) -> None:
    """Copy the checkpoint at `directory` into `model` (a Transformer of its shape).

    Raises:
        ConfigError: missing files, or tensors that do not match the shape; the
            message names `model.init_from` and the path.
    """
    params = model.state_dict()
    shapes = {name: param.shape for name, param in params.items()}
    with torch.no_grad():
        for name, tensor in hf_values(directory, model.shape, shapes):
            params[name].copy_(tensor.to(params[name].dtype))


def hf_values(
    directory: str | Path, shape: ModelShape, shapes: dict[str, torch.Size]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors under our names, in the order of `shapes` (a model's
    parameters and their whole shapes), each checked against its shape: what a rank whose
    parameters are already split or sharded copies its own part of.

    Raises:
        ConfigError: as `load_hf_weights`.
    """
    state = _matched_state(directory, shape, shapes, read_safetensors)
    for name in shapes:
        yield name, state.pop(name)


def check_hf_checkpoint(directory: str | Path, shape: ModelShape) -> None:
    """Refuse what `load_hf_weights` would refuse, from config.json and the safetensors
    headers alone (no tensor data is read): unreadable or truncated files, missing or
    unexpected tensors, tensors of the wrong shape. The driver calls it before any
    worker starts.

    Raises:
        ConfigError: naming `model.init_from` and the file or tensor to fix.
    """
    from ray_zep.model.llama import Transformer  # the model's names and shapes, on meta

    with torch.device("meta"):
        shapes = {name: param.shape for name, param in Transformer(shape).state_dict().items()}
    _matched_state(directory, shape, shapes, read_safetensors_header)


def _matched_state(
    directory: str | Path,
    shape: ModelShape,
    shapes: dict[str, torch.Size],
    read: Callable[[Path], dict[str, torch.Tensor]],
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under our names, each checked against its `shapes`."""
    config = read_hf_config(directory)
    architecture(config, str(Path(directory) / "config.json"))
    tensors = read_checkpoint_tensors(directory, read)
    state = hf_to_ours(tensors, shape, tied(config), str(directory))
    for name, tensor in state.items():
        if shapes[name] != tensor.shape:
            raise ConfigError(
                f"config key {INIT_KEY}: tensor for {name} in {directory} has shape "
                f"{tuple(tensor.shape)}, config.json implies {tuple(shapes[name])}"
            )
    return state


def read_checkpoint_tensors(
    directory: str | Path, read: Callable[[Path], dict[str, torch.Tensor]] | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory: model.safetensors, or the shards its
    model.safetensors.index.json lists, each read by `read` (default `read_safetensors`)."""
    read = read or read_safetensors
    root = Path(directory)
    if (root / SINGLE_FILE).is_file():
        return read(root / SINGLE_FILE)
    if not (root / INDEX_FILE).is_file():
        raise ConfigError(
            f"config key {INIT_KEY}={str(directory)!r}: neither {SINGLE_FILE} nor {INDEX_FILE} "
            f"is in {root}"
        )
    try:
        weight_map = json.loads((root / INDEX_FILE).read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"config key {INIT_KEY}: {root / INDEX_FILE} is unreadable: {exc}"
        ) from None
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(set(weight_map.values())):
        if not (root / file).is_file():
            raise ConfigError(
                f"config key {INIT_KEY}: shard {root / file} listed in {INDEX_FILE} is missing"
            )
        tensors.update(read(root / file))
    return tensors


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file.

    Raises:
        ConfigError: safetensors is not installed, or the file is not a safetensors file.
    """
    load_file, _ = _safetensors()
    try:
        return load_file(str(path))
    except Exception as exc:  # the library's own error types vary by version
        raise _unreadable(path, exc) from None


def read_safetensors_header(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors one safetensors file declares, as meta tensors of their shape and dtype.
    The library checks that the header is whole and that its tensors cover the file."""
    _safetensors()
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            declared = {
                name: (part.get_shape(), part.get_dtype())
                for name in handle.keys()  # noqa: SIM118 (a file handle, not a dict)
                for part in [handle.get_slice(name)]
            }
    except Exception as exc:  # the library's own error types vary by version
        raise _unreadable(path, exc) from None
    return {
        name: torch.empty(shape, dtype=_HEADER_DTYPES.get(kind, torch.float32), device="meta")
        for name, (shape, kind) in declared.items()
    }


_HEADER_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
"""safetensors' dtype names (the header's); the check needs shapes, the dtype is kept
where torch has it."""


def _unreadable(path: str | Path, exc: Exception) -> ConfigError:
    return ConfigError(f"config key {INIT_KEY}: {path} is not a readable safetensors file: {exc}")


def write_safetensors(tensors: dict[str, torch.Tensor], path: str | Path) -> Path:
    """Write CPU tensors as one safetensors file."""
    _, save_file = _safetensors()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), {"format": "pt"})
    return Path(path)


def _safetensors():
    """(load_file, save_file) of the safetensors library, or a ConfigError saying how to
    install it."""
    try:
        from safetensors.torch import load_file, save_file
    except ImportError:
        raise ConfigError(
            f"config key {INIT_KEY} and `ray-zep export` read and write safetensors files: "
            "pip install 'ray-zep[hf]'"
        ) from None
    return load_file, save_file


def hf_config_of(shape: ModelShape, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """config.json of a dense shape: Qwen2ForCausalLM when it has q/k/v biases, else
    LlamaForCausalLM; `base` (the source checkpoint's config) lends CARRIED_KEYS.

    Raises:
        ConfigError: an MoE shape (no such HF architecture here).
    """
    if shape.moe_experts:
        raise ConfigError(
            f"model.moe.num_experts={shape.moe_experts}: export writes dense "
            "LlamaForCausalLM / Qwen2ForCausalLM checkpoints only"
        )
    qwen = shape.qkv_bias
    config: dict[str, Any] = {
        "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen else "llama",
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.dim,
        "intermediate_size": shape.ffn_dim,
        "num_hidden_layers": shape.n_layers,
        "num_attention_heads": shape.n_heads,
        "num_key_value_heads": shape.n_kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": shape.norm_eps,
        "rope_theta": shape.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": shape.rope_theta},
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "max_position_embeddings": DEFAULT_MAX_POSITIONS,
        "torch_dtype": "float32",
        **({"use_sliding_window": False} if qwen else {"attention_bias": False, "mlp_bias": False}),
    }
    for key in CARRIED_KEYS:
        if base and key in base:
            config[key] = base[key]
    return config


def export_hf(
    state: dict[str, torch.Tensor],
    shape: ModelShape,
    out: str | Path,
    base: dict[str, Any] | None = None,
) -> Path:
    """Write config.json and model.safetensors of our model's state into `out`.

    Args:
        state: the whole model's state dict (our names, any dtype or device).
        shape: its shape.
        out: output directory (created).
        base: config.json of the checkpoint the model started from, if any.

    Returns:
        The output directory.
    """
    config = hf_config_of(shape, base)
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    write_safetensors(ours_to_hf(state, shape), root / SINGLE_FILE)
    (root / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return root
