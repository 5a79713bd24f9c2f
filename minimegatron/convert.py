"""Hand the model to the Hugging Face ecosystem, and take one back (chapter 08 §5b).

    python -m minimegatron.convert --load runs/ckpt --to-hf runs/hf          # book -> HF
    python -m minimegatron.convert --from-hf runs/hf --save runs/ckpt2       # HF -> book

--to-hf reads a torch_dist checkpoint (any layout) as the single-device model and writes
config.json (LlamaForCausalLM, or MixtralForCausalLM for a mixture), model.safetensors (written
here: 8-byte little-endian header size, JSON header, raw bytes; the checkpoint's dtype),
tokenizer.json and tokenizer_config.json (the book's BPE file as it is, or the byte tokenizer as
a byte-level BPE without merges: ids 0-255 the bytes, 256 "<eod>").
--from-hf writes a torch_dist checkpoint of the model alone, iteration 0, a release (train
--load starts from it under any layout); another tokenizer.json is copied beside it.

Refused by name, before anything is written: what the model or config.json cannot express,
weights that are not the config's model, a malformed file, a non-empty folder without --force.

The names (model/gpt.py -> transformers):

  embedding.word_embeddings.weight              model.embed_tokens.weight
  decoder.layers.i.input_layernorm.weight       model.layers.i.input_layernorm.weight
  decoder.layers.i.self_attention.linear_qkv    model.layers.i.self_attn.{q,k,v}_proj: the book's
                                                rows are group by group, [a/g query heads; k; v]
  decoder.layers.i.self_attention.linear_proj   model.layers.i.self_attn.o_proj
  decoder.layers.i.pre_mlp_layernorm.weight     model.layers.i.post_attention_layernorm.weight
  decoder.layers.i.mlp.linear_fc1.weight        model.layers.i.mlp.{gate,up}_proj: [gate; up]
  decoder.layers.i.mlp.linear_fc2.weight        model.layers.i.mlp.down_proj
  decoder.final_layernorm.weight                model.norm.weight
  output_layer.weight (untied)                  lm_head.weight
  a mixture (Mixtral, transformers 5's layout):
  decoder.layers.i.mlp.router.weight            model.layers.i.mlp.gate.weight [E, h]
  ...mlp.experts.local_experts.j.linear_fc1     model.layers.i.mlp.experts.gate_up_proj[j] [2 f_e, h]
  ...mlp.experts.local_experts.j.linear_fc2     model.layers.i.mlp.experts.down_proj[j] [h, f_e]

Megatron: tools/checkpoint/ (loader_mixtral_hf.py, schema_hf.py); Megatron Bridge.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import struct
import sys
from pathlib import Path

import torch

from .checkpoint import CheckpointError, _atomic_write
from .config import ConfigError, ModelConfig, to_dict
from .data.errors import DataError
from .data.tokenizer import EOD_TEXT

__all__ = ["to_hf_state", "from_hf_state", "hf_config", "model_config_from_hf", "check_hf_weights", "read_hf_config",
           "save_safetensors", "load_safetensors", "byte_tokenizer_json", "export_hf", "import_hf", "main"]

_DTYPES = {torch.float32: "F32", torch.float64: "F64", torch.bfloat16: "BF16", torch.float16: "F16",
           torch.int64: "I64", torch.int32: "I32"}


# ---------------------------------------------------------------------------------------
# safetensors, written and read here
# ---------------------------------------------------------------------------------------
def save_safetensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike, metadata: dict | None = None) -> None:
    """Write `tensors` as a .safetensors file (atomically: a temporary name, then a rename)."""
    header, offset, blobs = {}, 0, []
    for name, t in tensors.items():
        if t.dtype not in _DTYPES:
            raise ValueError(f"{name}: dtype {t.dtype} has no safetensors name here")
        data = t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    header["__metadata__"] = {"format": "pt", **(metadata or {})}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)                        # the data starts 8-byte aligned
    _atomic_write(Path(path), lambda tmp: tmp.write_bytes(b"".join([struct.pack("<Q", len(text)), text, *blobs])))


def load_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The tensors of a .safetensors file (copies; no code runs, there is none in the format).
    CheckpointError naming the file and the tensor for anything the format does not allow: a
    header past the end, a header that is not a JSON object, a dtype outside _DTYPES, a shape
    whose bytes are not its data_offsets' span, data past the end of the file."""
    raw = Path(path).read_bytes()
    if len(raw) < 8:
        raise CheckpointError(f"{path}: {len(raw)} bytes, too short for a safetensors file")
    (size,) = struct.unpack("<Q", raw[:8])
    if 8 + size > len(raw):
        raise CheckpointError(f"{path}: its header size {size} runs past the end of the file ({len(raw)} bytes): "
                              f"not a safetensors file, or truncated")
    try:
        header = json.loads(raw[8:8 + size])
    except ValueError as exc:
        raise CheckpointError(f"{path}: its header is not JSON ({exc}): not a safetensors file, or truncated") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: its header is a JSON {type(header).__name__}, not an object of tensors")
    names = {v: k for k, v in _DTYPES.items()}
    out = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(spec, dict) or not {"dtype", "shape", "data_offsets"} <= set(spec):
            raise CheckpointError(f"{path}: tensor {name}'s entry {spec!r} lacks dtype, shape or data_offsets")
        dtype, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
        if dtype not in names:
            raise CheckpointError(f"{path}: tensor {name} has dtype {dtype!r}; the book reads {', '.join(names)}")
        if not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)):
            raise CheckpointError(f"{path}: tensor {name} has shape {shape!r}, not a list of sizes >= 0")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(n, int) for n in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise CheckpointError(f"{path}: tensor {name} has data_offsets {offsets!r}, not [begin, end] with "
                                  f"0 <= begin <= end")
        lo, hi = offsets
        nbytes = torch.Size(shape).numel() * names[dtype].itemsize
        if hi - lo != nbytes:
            raise CheckpointError(f"{path}: tensor {name} of shape {shape} and dtype {dtype} is {nbytes} bytes, "
                                  f"but its data_offsets [{lo}, {hi}] span {hi - lo}")
        if 8 + size + hi > len(raw):
            raise CheckpointError(f"{path}: {name} ends past the end of the file (truncated?)")
        data = bytearray(raw[8 + size + lo: 8 + size + hi])
        out[name] = torch.frombuffer(data, dtype=names[dtype]).view(shape) if data else \
            torch.empty(shape, dtype=names[dtype])
    return out


# ---------------------------------------------------------------------------------------
# the names and the config
# ---------------------------------------------------------------------------------------
# Mixtral: every layer a mixture, softmax over all experts then the top k renormalised (the same
# weights as the book's softmax over the chosen k), no bias, no shared expert. {field: (refused, why)}
_NOT_MIXTRAL = {"moe_layer_freq": (lambda v: v != 1, "Mixtral's every layer is a mixture"),
                "moe_shared_expert_intermediate_size": (lambda v: v is not None, "Mixtral has no shared expert"),
                "moe_router_score_function": (lambda v: v != "softmax", "Mixtral's router is a softmax"),
                "moe_router_pre_softmax": (bool, "Mixtral renormalises the chosen k"),
                "moe_router_enable_expert_bias": (bool, "Mixtral's router has no bias"),
                "moe_expert_capacity_factor": (lambda v: v is not None, "Mixtral drops no token")}


def _check_exportable(cfg: ModelConfig) -> None:
    """ConfigError naming every field that LlamaForCausalLM (dense) or MixtralForCausalLM (a
    mixture of experts) cannot express."""
    arch = "LlamaForCausalLM" if cfg.num_experts is None else "MixtralForCausalLM"
    why = [f"{field}={value!r} ({arch} has {want!r})" for field, value, want in
           (("normalization", cfg.normalization, "RMSNorm"), ("activation", cfg.activation, "swiglu"),
            ("position_embedding_type", cfg.position_embedding_type, "rope"))
           if value != want]
    if cfg.add_bias_linear:
        why.append("add_bias_linear=True (the converter maps no biases: --disable-bias-linear)")
    if cfg.num_experts is not None:
        why += [f"{field}={getattr(cfg, field)!r} ({reason})" for field, (refused, reason) in _NOT_MIXTRAL.items()
                if refused(getattr(cfg, field))]
    if why:
        raise ConfigError(f"this model cannot be written as {arch}: " + "; ".join(why))


def hf_config(cfg: ModelConfig, eod: int) -> dict:
    """config.json of LlamaForCausalLM for the book's LLaMA-style `cfg` (end of text: id `eod`)."""
    _check_exportable(cfg)
    moe = {} if cfg.num_experts is None else {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "intermediate_size": cfg.moe_ffn_size,
        "num_local_experts": cfg.num_experts, "num_experts_per_tok": cfg.moe_router_topk,
        "router_aux_loss_coef": cfg.moe_aux_loss_coeff, "output_router_logits": False}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_size,
            "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.query_groups, "head_dim": cfg.kv_channels, "hidden_act": "silu",
            "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.layernorm_epsilon,
            "rope_theta": cfg.rotary_base, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rotary_base},
            "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
            "attention_bias": cfg.add_bias_linear, "mlp_bias": cfg.add_bias_linear,
            "attention_dropout": cfg.attention_dropout, "bos_token_id": None, "eos_token_id": eod,
            "initializer_range": cfg.init_method_std, "dtype": cfg.params_dtype, "use_cache": True} | moe


_REQUIRED = {"llama": ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "max_position_embeddings", "rms_norm_eps"),
             "mixtral": ("num_local_experts", "num_experts_per_tok")}
_NUMBERS = ("rms_norm_eps", "rope_theta", "router_aux_loss_coef", "router_jitter_noise")


def _inexpressible(config: dict) -> list[str]:
    """The fields of a LlamaForCausalLM or MixtralForCausalLM config.json whose value the book's
    LLaMA-style model cannot express, each as "field=value (what the book has)"."""
    rope = config.get("rope_parameters") or {}
    checks = [
        ("hidden_act", config.get("hidden_act", "silu"), lambda v: v == "silu",
         "the book's MLP is SwiGLU, hidden_act 'silu'"),
        ("rope_scaling", config.get("rope_scaling"),
         lambda v: v is None or isinstance(v, dict) and v.get("rope_type", v.get("type")) == "default",
         "the book's RoPE is unscaled, rope_scaling null"),
        ("rope_parameters.rope_type", rope.get("rope_type", "default") if isinstance(rope, dict) else rope,
         lambda v: v == "default",
         "the book's RoPE is unscaled, rope_type 'default'"),
        ("attention_bias", config.get("attention_bias", False), lambda v: v is False,
         "the converter maps no biases, attention_bias false"),
        ("mlp_bias", config.get("mlp_bias", False), lambda v: v is False,
         "the converter maps no biases, mlp_bias false"),
        ("sliding_window", config.get("sliding_window"), lambda v: v is None,
         "the book's attention sees every earlier position, sliding_window null"),
        ("router_jitter_noise", config.get("router_jitter_noise", 0.0), lambda v: v == 0,
         "the book's router adds no noise, router_jitter_noise 0")]
    return [f"{field}={value!r} ({book})" for field, value, ok, book in checks if not ok(value)]


def model_config_from_hf(config: dict) -> ModelConfig:
    """The book's ModelConfig for a LlamaForCausalLM or MixtralForCausalLM config.json, as
    read_hf_config reads it. ConfigError naming the field for another model, a missing or
    mistyped field, or a field whose value the book's model cannot express (_inexpressible)."""
    if config.get("model_type") not in ("llama", "mixtral"):
        raise ConfigError(f"model_type={config.get('model_type')!r}: only LlamaForCausalLM ('llama') and "
                          f"MixtralForCausalLM ('mixtral') are read here")
    kind = config["model_type"]
    required = _REQUIRED["llama"] + (_REQUIRED["mixtral"] if kind == "mixtral" else ())
    missing = [name for name in required if name not in config]
    if missing:
        raise ConfigError(f"config.json (model_type {kind!r}) lacks {', '.join(missing)}")
    ints = [name for name in required + ("num_key_value_heads", "head_dim") if name not in _NUMBERS]
    for name in ints + list(_NUMBERS):
        value, number = config.get(name), name in _NUMBERS
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float) if number else int)):
            raise ConfigError(f"config.json: {name}={value!r} is not {'a number' if number else 'an integer'}")
    why = _inexpressible(config)
    if why:
        raise ConfigError("config.json has what the book's model cannot express: " + "; ".join(why))
    moe = {} if kind == "llama" else dict(
        num_experts=config["num_local_experts"], moe_router_topk=config["num_experts_per_tok"],
        moe_ffn_hidden_size=config["intermediate_size"], moe_aux_loss_coeff=config.get("router_aux_loss_coef", 0.0))
    heads = config["num_attention_heads"]
    if heads < 1:
        raise ConfigError(f"config.json: num_attention_heads={heads} must be positive")
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    if head_dim * heads != config["hidden_size"]:
        raise ConfigError(f"head_dim={head_dim} x num_attention_heads={heads} != hidden_size={config['hidden_size']}: "
                          f"the book's head size is always hidden_size / num_attention_heads")
    rope = (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta", 10000.0))
    if isinstance(rope, bool) or not isinstance(rope, (int, float)):
        raise ConfigError(f"config.json: rope_theta={rope!r} is not a number")
    try:
        return ModelConfig.llama(
            vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
            ffn_hidden_size=config["intermediate_size"], num_layers=config["num_hidden_layers"],
            num_attention_heads=heads, num_query_groups=config.get("num_key_value_heads", heads),
            max_position_embeddings=config["max_position_embeddings"], layernorm_epsilon=config["rms_norm_eps"],
            rotary_base=float(rope), untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", False),
            add_bias_linear=False,
            params_dtype=str(config.get("dtype") or config.get("torch_dtype") or "float32"), **moe).validate()
    except ConfigError as exc:                      # the book's field names, with config.json's beside them
        message = str(exc)
        for book, hf in _HF_NAMES.items():
            message = message.replace(f"{book}=", f"{book} (config.json's {hf})=")
        raise ConfigError(message) from None


_HF_NAMES = {"num_layers": "num_hidden_layers", "ffn_hidden_size": "intermediate_size",
             "num_query_groups": "num_key_value_heads", "layernorm_epsilon": "rms_norm_eps",
             "rotary_base": "rope_theta", "params_dtype": "dtype", "num_experts": "num_local_experts", "moe_router_topk": "num_experts_per_tok",
             "moe_ffn_hidden_size": "intermediate_size"}


def _top_names(cfg: ModelConfig) -> dict[str, str]:
    """The book's -> transformers' names outside the layers (all one to one)."""
    names = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
             "decoder.final_layernorm.weight": "model.norm.weight"}
    if cfg.untie_embeddings_and_output_weights:
        names["output_layer.weight"] = "lm_head.weight"
    return names


def _layer_names(i: int, cfg: ModelConfig) -> dict[str, str]:
    """The book's -> transformers' names of layer i that map one to one."""
    book, hf = f"decoder.layers.{i}.", f"model.layers.{i}."
    names = {book + "input_layernorm.weight": hf + "input_layernorm.weight",
             book + "self_attention.linear_proj.weight": hf + "self_attn.o_proj.weight",
             book + "pre_mlp_layernorm.weight": hf + "post_attention_layernorm.weight"}
    if cfg.num_experts is None:
        names[book + "mlp.linear_fc2.weight"] = hf + "mlp.down_proj.weight"
    return names


class _Reads(dict):
    """A state dict that remembers the names read from it, and names a missing one."""

    def __init__(self, state: dict, where: str):
        super().__init__(state)
        self.where, self.read = where, set()

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self:
            raise CheckpointError(f"{self.where} lacks {name}")
        self.read.add(name)
        return super().__getitem__(name)


def to_hf_state(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The book's single-device state dict -> LlamaForCausalLM's (the module docstring's table).
    CheckpointError when `state` lacks a tensor of `cfg`'s model or holds one the table has no
    place for (nothing is dropped silently)."""
    _check_exportable(cfg)
    state = _Reads(state, "the checkpoint")
    a, g, d, h, f = cfg.num_attention_heads, cfg.query_groups, cfg.kv_channels, cfg.hidden_size, cfg.ffn_size
    n = a // g
    out = {hf: state[book] for book, hf in _top_names(cfg).items()}
    for i in range(cfg.num_layers):
        out.update({hf: state[book] for book, hf in _layer_names(i, cfg).items()})
        qkv = state[f"decoder.layers.{i}.self_attention.linear_qkv.weight"].view(g, n + 2, d, h)   # group by group
        attn = f"model.layers.{i}.self_attn."
        out[attn + "q_proj.weight"] = qkv[:, :n].reshape(a * d, h)
        out[attn + "k_proj.weight"] = qkv[:, n].reshape(g * d, h)
        out[attn + "v_proj.weight"] = qkv[:, n + 1].reshape(g * d, h)
        mlp, hf_mlp = f"decoder.layers.{i}.mlp.", f"model.layers.{i}.mlp."
        if cfg.num_experts is None:
            gate, up = state[mlp + "linear_fc1.weight"].split(f)                                     # [gate; up]
            out[hf_mlp + "gate_proj.weight"], out[hf_mlp + "up_proj.weight"] = gate, up
            continue
        experts = [f"{mlp}experts.local_experts.{j}." for j in range(cfg.num_experts)]
        out[hf_mlp + "gate.weight"] = state[mlp + "router.weight"]                                  # [E, h]
        # transformers 5 keeps the experts as 3-D tensors: [E, 2 f_e, h] ([gate; up] each) and [E, h, f_e]
        out[hf_mlp + "experts.gate_up_proj"] = torch.stack([state[e + "linear_fc1.weight"] for e in experts])
        out[hf_mlp + "experts.down_proj"] = torch.stack([state[e + "linear_fc2.weight"] for e in experts])
    left = sorted(set(state) - state.read)
    if left:
        raise CheckpointError(f"the checkpoint holds {len(left)} tensors the Hugging Face names have no place for: "
                              f"{_some(left)}")
    return {k: v.contiguous() for k, v in out.items()}


def _some(names: list[str], shown: int = 3) -> str:
    """The first `shown` of `names`, and how many more."""
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def _expected_hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """{Hugging Face name: shape} of `cfg`'s model: the book's model built on the meta device
    (no memory, no values) and mapped by to_hf_state."""
    from .model import GPTModel
    with torch.device("meta"):
        state = GPTModel(cfg).state_dict()
    return {name: tuple(t.shape) for name, t in to_hf_state(state, cfg).items()}


def _check_finite(tensors: dict[str, torch.Tensor], where: str) -> None:
    """CheckpointError naming the first tensor of `tensors` that holds a NaN or an infinity."""
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise CheckpointError(f"{where}: {name} holds {bad} non-finite values (NaN or inf) of {t.numel()}")


def check_hf_weights(hf: dict[str, torch.Tensor], cfg: ModelConfig, where: str = "model.safetensors") -> None:
    """CheckpointError unless `hf` holds exactly the tensors of `cfg`'s model under
    transformers' names (none missing, none left over: a Mixtral config with dense weights, or
    fewer num_hidden_layers than the file holds, is refused), each of its shape, all of
    cfg.params_dtype, all finite. A tied model's lm_head.weight may be present when it equals
    the embedding (transformers writes it so)."""
    arch = "LlamaForCausalLM" if cfg.num_experts is None else "MixtralForCausalLM"
    want = _expected_hf_shapes(cfg)
    names = [n for n in hf if not (n == "lm_head.weight" and n not in want)]
    if "lm_head.weight" in hf and "lm_head.weight" not in want:
        embed, head = hf.get("model.embed_tokens.weight"), hf["lm_head.weight"]
        if embed is None or head.shape != embed.shape or not torch.equal(head, embed):
            raise CheckpointError(f"{where}: lm_head.weight differs from model.embed_tokens.weight, but config.json "
                                  f"says tie_word_embeddings=true (one matrix for both)")
    missing, extra = [n for n in want if n not in hf], sorted(n for n in names if n not in want)
    if missing or extra:
        found = f"{cfg.num_experts} experts" if cfg.num_experts else "a dense MLP"
        if cfg.num_experts and any(n.endswith("mlp.gate_proj.weight") for n in extra):
            found += ", but the weights are dense"
        if not cfg.num_experts and any(".mlp.experts." in n for n in extra):
            found += ", but the weights hold experts"
        parts = ([f"missing {len(missing)}: {_some(missing)}"] if missing else []) + \
                ([f"not in the model {len(extra)}: {_some(extra)}"] if extra else [])
        raise CheckpointError(f"{where} does not hold the {arch} of config.json ({cfg.num_layers} layers, {found}): "
                              + "; ".join(parts))
    rows = hf["model.embed_tokens.weight"].shape[0]
    if rows != cfg.vocab_size:
        raise CheckpointError(f"config.json says vocab_size={cfg.vocab_size}, but {where}'s model.embed_tokens.weight "
                              f"has {rows} rows")
    for name, shape in want.items():
        if tuple(hf[name].shape) != shape:
            raise CheckpointError(f"{where}: {name} has shape {list(hf[name].shape)}; config.json's {arch} needs "
                                  f"{list(shape)}")
    for name in names:
        if hf[name].dtype != cfg.dtype:
            raise CheckpointError(f"{where}: {name} is {str(hf[name].dtype).removeprefix('torch.')}, but config.json's "
                                  f"dtype is {cfg.params_dtype}")
    _check_finite(hf, where)


def from_hf_state(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """LlamaForCausalLM's state dict -> the book's (to_hf_state's inverse, bit for bit), after
    check_hf_weights."""
    check_hf_weights(hf, cfg)
    a, g, d, h = cfg.num_attention_heads, cfg.query_groups, cfg.kv_channels, cfg.hidden_size
    out = {book: hf[name] for book, name in _top_names(cfg).items()}
    for i in range(cfg.num_layers):
        out.update({book: hf[name] for book, name in _layer_names(i, cfg).items()})
        attn = f"model.layers.{i}.self_attn."
        q = hf[attn + "q_proj.weight"].view(g, a // g, d, h)
        k, v = hf[attn + "k_proj.weight"].view(g, 1, d, h), hf[attn + "v_proj.weight"].view(g, 1, d, h)
        out[f"decoder.layers.{i}.self_attention.linear_qkv.weight"] = torch.cat([q, k, v], 1).reshape(-1, h)
        mlp, book_mlp = f"model.layers.{i}.mlp.", f"decoder.layers.{i}.mlp."
        if cfg.num_experts is None:
            out[book_mlp + "linear_fc1.weight"] = torch.cat([hf[mlp + "gate_proj.weight"], hf[mlp + "up_proj.weight"]])
            continue
        out[book_mlp + "router.weight"] = hf[mlp + "gate.weight"]
        for j in range(cfg.num_experts):
            out[f"{book_mlp}experts.local_experts.{j}.linear_fc1.weight"] = hf[mlp + "experts.gate_up_proj"][j]
            out[f"{book_mlp}experts.local_experts.{j}.linear_fc2.weight"] = hf[mlp + "experts.down_proj"][j]
    return {k: v.contiguous() for k, v in out.items()}


# ---------------------------------------------------------------------------------------
# the tokenizer
# ---------------------------------------------------------------------------------------
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte a printable character (the printable bytes are
    themselves, the others shifted past 255), which `tokenizers`' ByteLevel pre-tokenizer uses."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(others)}


def byte_tokenizer_json() -> dict:
    """The book's byte tokenizer as a `tokenizers` JSON: a byte-level BPE without merges, so each
    byte is one token with the byte's value as id; "<eod>" (id 256) a special token."""
    alphabet = _bytes_to_unicode()
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    return {"version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [{"id": 256, "content": EOD_TEXT, "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False, "special": True}],
            "normalizer": None, "pre_tokenizer": byte_level, "post_processor": None, "decoder": byte_level,
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": {alphabet[b]: b for b in range(256)}, "merges": []}}


def _write_tokenizer(tokenizer: str, out: Path) -> None:
    if tokenizer == "byte":
        _atomic_write(out / "tokenizer.json", lambda tmp: tmp.write_text(json.dumps(byte_tokenizer_json())))
    else:
        shutil.copyfile(tokenizer, out / "tokenizer.json")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOD_TEXT, "model_max_length": 10**9,
              "clean_up_tokenization_spaces": False}
    _atomic_write(out / "tokenizer_config.json", lambda tmp: tmp.write_text(json.dumps(config, indent=1)))


# ---------------------------------------------------------------------------------------
# the two directions
# ---------------------------------------------------------------------------------------
def _check_target(path: str | os.PathLike, flag: str, force: bool) -> None:
    """CheckpointError when `path` (what `flag` names) is a file, or a folder that already holds
    something and `force` is off: a conversion never overwrites silently."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{flag} {path} is a file, not a folder")
    held = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    if held and not force:
        what = (f"a checkpoint (latest: {(path / 'latest').read_text().strip() or '?'}), whose `latest` would then "
                f"name this release at iteration 0" if (path / "latest").is_file() else _some(held))
        raise CheckpointError(f"{flag} {path} is not empty, it holds {what}: give an empty or new folder, or --force "
                              f"to write into it anyway")


def export_hf(load: str | os.PathLike, out: str | os.PathLike, *, force: bool = False) -> Path:
    """Write the model of the torch_dist checkpoint `load` (a directory with `latest`, or one
    iteration's) as a Hugging Face folder `out` (module docstring). Returns `out`.
    CheckpointError when `out` is a file, or holds anything and `force` is off."""
    from .data import build_tokenizer
    from .dist_checkpoint import find_distributed_checkpoint, load_full_state, read_common
    path = find_distributed_checkpoint(load, "--from-hf DIR --save CKPT",
                                       " (train with --ckpt-format torch_dist to write one)")
    _check_target(out, "--to-hf", force)
    common = read_common(path)
    cfg = ModelConfig(**common["model_config"]).validate()
    tokenizer_spec = common.get("train_config", {}).get("tokenizer", "byte")
    config = hf_config(cfg, build_tokenizer(tokenizer_spec).eod)
    state = load_full_state(path)
    _check_finite(state, str(path))
    weights = to_hf_state(state, cfg)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_safetensors(weights, out / "model.safetensors", {"source": str(path)})
    _atomic_write(out / "config.json", lambda tmp: tmp.write_text(json.dumps(config, indent=1)))
    _write_tokenizer(tokenizer_spec, out)
    return out


def read_hf_config(folder: Path) -> dict:
    """config.json of the Hugging Face folder `folder` as a dict (ConfigError when it is not
    JSON, or not a JSON object)."""
    file = folder / "config.json"
    try:
        config = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{file} is not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{file} holds a JSON {type(config).__name__}, not an object of fields")
    return config


def import_hf(folder: str | os.PathLike, save: str | os.PathLike, *, force: bool = False) -> Path:
    """Write the Hugging Face `folder` (config.json, model.safetensors) as a torch_dist release
    checkpoint of the model alone, iteration 0, in `save`. ConfigError for a config the model cannot
    express; CheckpointError for weights that are not its (check_hf_weights), and for a `save` that
    is a file or holds anything, unless `force`."""
    from .dist_checkpoint import save_release
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"--from-hf {folder} {'does not exist' if not folder.exists() else 'is a file'}: "
                              f"give a Hugging Face model folder (config.json, model.safetensors)")
    for name in ("config.json", "model.safetensors"):
        if not (folder / name).is_file():
            raise CheckpointError(f"{folder / name} does not exist: not a Hugging Face model folder")
    _check_target(save, "--save", force)
    config = read_hf_config(folder)
    cfg = model_config_from_hf(config)
    hf = load_safetensors(folder / "model.safetensors")
    dtypes = {t.dtype for t in hf.values()}
    if not (config.get("dtype") or config.get("torch_dtype")) and len(dtypes) == 1:
        cfg = dataclasses.replace(cfg, params_dtype=str(dtypes.pop()).removeprefix("torch.")).validate()
    state = from_hf_state(hf, cfg)
    tokenizer = _read_tokenizer(folder, cfg)
    if tokenizer == "copy":                                  # another tokenizer: kept beside the checkpoint
        Path(save).mkdir(parents=True, exist_ok=True)
        tokenizer = str(Path(save).resolve() / "tokenizer.json")
        shutil.copyfile(folder / "tokenizer.json", tokenizer)
    return save_release(save, state, {"model_config": to_dict(cfg), "source": str(folder)} | (
        {} if tokenizer is None else {"train_config": {"tokenizer": tokenizer}}))


def _read_tokenizer(folder: Path, cfg: ModelConfig) -> str | None:
    """Which tokenizer the imported checkpoint records: "byte" (the byte tokenizer as export_hf writes
    it), "copy" (another tokenizer.json the book reads, copied beside the checkpoint), None (no
    tokenizer.json: byte assumed). ConfigError when the book cannot read the file (no "<eod>") or
    its ids exceed vocab_size."""
    from .data import build_tokenizer
    file = folder / "tokenizer.json"
    if not file.is_file():
        return None
    try:
        if json.loads(file.read_text()) == byte_tokenizer_json():
            return "byte"
        vocab = build_tokenizer(file).vocab_size
    except (ValueError, UnicodeDecodeError) as exc:          # not JSON; DataError: not a tokenizer the book reads
        raise ConfigError(f"{file}: not a tokenizer the book reads ({exc})") from None
    if vocab > cfg.vocab_size:
        raise ConfigError(f"{file} has {vocab} tokens, more than config.json's vocab_size={cfg.vocab_size}")
    return "copy"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minimegatron.convert", description=__doc__.split("\n\n")[0])
    parser.add_argument("--load", help="a torch_dist checkpoint directory (with --to-hf)")
    parser.add_argument("--to-hf", help="the Hugging Face folder to write: new or empty (else --force)")
    parser.add_argument("--from-hf", help="a Hugging Face LlamaForCausalLM or MixtralForCausalLM folder to read")
    parser.add_argument("--save", help="the torch_dist checkpoint directory to write (with --from-hf): new or empty "
                                       "(else --force)")
    parser.add_argument("--force", action="store_true",
                        help="write into a folder that already holds files: --to-hf overwrites its config.json, "
                             "model.safetensors and tokenizer files; --save writes iteration 0 and re-points "
                             "`latest` to it")
    args = parser.parse_args(argv)
    try:
        if args.load and args.to_hf and not (args.from_hf or args.save):
            print(f"wrote {export_hf(args.load, args.to_hf, force=args.force)}: config.json, model.safetensors, "
                  f"tokenizer.json")
        elif args.from_hf and args.save and not (args.load or args.to_hf):
            print(f"wrote {import_hf(args.from_hf, args.save, force=args.force)}: `train --load {args.save}` "
                  f"starts from it")
        else:
            parser.error("give --load CKPT --to-hf OUT, or --from-hf DIR --save CKPT")
    except (CheckpointError, ConfigError, DataError, OSError) as exc:   # OSError: unreadable input, unwritable output
        print(f"error: {exc.strerror or exc}: {exc.filename}" if isinstance(exc, OSError) else f"error: {exc}",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
