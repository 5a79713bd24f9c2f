"""Putting the numbers together: a memory table and real model sizes (chapter 00).

`memory_report` adds what one training step keeps on one device, parameters + gradients +
optimizer state (memory.py) + activations (activations.py); `does_it_fit` applies it to a
published model (GPT-3 175B: 2602 GiB of states alone)."""

from __future__ import annotations

import math

import torch

from ..config import ModelConfig
from .activations import activation_memory
from .memory import as_dtype, bytes_per_element, training_memory

GiB = 2**30

# Published shapes. Parameter counts these give: gpt2-small 124,439,808 (Radford et al. 2019,
# the "124M" checkpoint), gpt3-175b 174.6e9 (Brown et al. 2020, Table 2.1, "175.0B"),
# llama2-7b 6,738,415,616 and llama2-70b 68,976,648,192 (Touvron et al. 2023, "Llama 2").
REAL_MODELS: dict[str, dict] = {
    "gpt2-small": dict(style="gpt2", num_layers=12, hidden_size=768, num_attention_heads=12,
                       vocab_size=50257, max_position_embeddings=1024, seq=1024),
    "gpt3-175b": dict(style="gpt2", num_layers=96, hidden_size=12288, num_attention_heads=96,
                      vocab_size=50257, max_position_embeddings=2048, seq=2048),
    "llama2-7b": dict(style="llama", num_layers=32, hidden_size=4096, num_attention_heads=32,
                      num_query_groups=32, ffn_hidden_size=11008, vocab_size=32000,
                      max_position_embeddings=4096, seq=4096),
    "llama2-70b": dict(style="llama", num_layers=80, hidden_size=8192, num_attention_heads=64,
                       num_query_groups=8, ffn_hidden_size=28672, vocab_size=32000,
                       max_position_embeddings=4096, seq=4096),
}


def real_model_config(name: str) -> tuple[ModelConfig, int]:
    """(ModelConfig, training sequence length) of a published model in REAL_MODELS; only a
    description, nothing allocated (GPT-3: Brown et al. 2020, Table 2.1)."""
    if name not in REAL_MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(REAL_MODELS)}")
    spec = dict(REAL_MODELS[name])
    style, seq = spec.pop("style"), spec.pop("seq")
    preset = ModelConfig.gpt2 if style == "gpt2" else ModelConfig.llama
    return preset(params_dtype="bfloat16", **spec).validate(), seq


def memory_report(config: ModelConfig, batch: int, seq: int, *,
                  dtype: torch.dtype | str | None = None, master_weights: bool | None = None,
                  grad_dtype: torch.dtype | str | None = None, optimizer: str = "adam",
                  zero_stage: int = 0, dp: int = 1, dropout_mask_itemsize: int | None = None) -> dict:
    """Bytes one device holds to train `config` on [batch, seq] micro-batches: params + grads +
    optimizer (`training_memory`) + activations (`activation_memory`, per micro-batch, never
    sharded). dtype: default config.params_dtype; master_weights: default True for 16-bit models;
    zero_stage and dp shard the first three as ZeRO does. Returns {"params", "grads", "optimizer",
    "activations", "total"} in bytes, plus "num_parameters", "bytes_per_parameter",
    "activation_detail" and the settings used."""
    dtype = config.dtype if dtype is None else as_dtype(dtype)
    if master_weights is None:
        master_weights = bytes_per_element(dtype) == 2
    states = training_memory(config, param_dtype=dtype, grad_dtype=grad_dtype, optimizer=optimizer,
                             master_weights=master_weights, zero_stage=zero_stage, dp=dp)
    acts = activation_memory(config, batch, seq, dtype, dropout_mask_itemsize=dropout_mask_itemsize)
    report = {"params": states["params"], "grads": states["grads"], "optimizer": states["optimizer"],
              "activations": acts["total"]}
    report["total"] = sum(report.values())
    report.update(num_parameters=states["num_parameters"],
                  bytes_per_parameter=states["bytes_per_parameter"], activation_detail=acts,
                  dtype=str(dtype).replace("torch.", ""), master_weights=master_weights,
                  batch=batch, seq=seq, zero_stage=zero_stage, dp=dp)
    return report


def format_bytes(n: float) -> str:
    """1536 -> '1.50 KiB'; binary units, as GPU memory is sold (80 GB = 80 GiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def format_memory_report(report: dict, title: str | None = None) -> str:
    """A plain-text table of a `memory_report`, for chapter 00's demo and notebook."""
    per_param = report["bytes_per_parameter"]
    lines = []
    if title:
        lines.append(title)
    lines.append(f"{report['num_parameters']:,} parameters, {report['dtype']}, "
                 f"master weights: {'yes' if report['master_weights'] else 'no'}, "
                 f"micro-batch {report['batch']} x {report['seq']} tokens"
                 + (f", ZeRO-{report['zero_stage']} over dp={report['dp']}" if report["zero_stage"] else ""))
    lines.append(f"  {'':<13}{'bytes':>19}  {'':>12}  {'share':>6}")
    sharded_from = {"optimizer": 1, "grads": 2, "params": 3}       # the ZeRO stage that shards it
    notes = {key: f"{per_param[key]} B/param" + (f" / dp={report['dp']}"
                                                 if report["zero_stage"] >= stage else "")
             for key, stage in sharded_from.items()}
    notes["activations"] = "per micro-batch"
    for key in ("params", "grads", "optimizer", "activations", "total"):
        share = 100.0 * report[key] / report["total"] if report["total"] else 0.0
        lines.append(f"  {key:<13}{report[key]:>19,}  {format_bytes(report[key]):>12}  {share:>5.1f}%"
                     + (f"   {notes[key]}" if key in notes else ""))
    return "\n".join(lines)


def does_it_fit(name: str = "gpt3-175b", *, device_memory_gib: float = 80, batch: int = 1,
                seq: int | None = None, dtype: str = "bfloat16", master_weights: bool = True) -> dict:
    """Does training the published model `name` fit ONE device? Mixed-precision Adam, 16 bytes per
    parameter plus one micro-batch's activations (the config's attention backend, "sdpa" by
    default). Returns the `memory_report` plus "device_bytes", "fits", "devices_needed" (states and
    activations over one device, rounded up: a lower bound) and "table" (the printed form)."""
    config, default_seq = real_model_config(name)
    seq = default_seq if seq is None else seq
    report = memory_report(config, batch, seq, dtype=dtype, master_weights=master_weights)
    device = int(device_memory_gib * GiB)
    report.update(model=name, device_bytes=device, fits=report["total"] <= device,
                  devices_needed=math.ceil(report["total"] / device))
    verdict = (f"fits one {device_memory_gib:g} GiB device" if report["fits"] else
               f"does NOT fit one {device_memory_gib:g} GiB device: needs at least "
               f"{report['devices_needed']} of them")
    report["table"] = format_memory_report(report, title=f"{name}: {verdict}")
    return report


__all__ = ["REAL_MODELS", "GiB", "real_model_config", "memory_report", "format_memory_report", "does_it_fit"]
