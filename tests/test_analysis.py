"""Accounting (minimegatron.analysis) checked against measurements of the real model.

Each formula is compared with something it does not compute itself: the numel of the real
parameters, FlopCounterMode, the state torch.optim.AdamW allocates, the tensors autograd
saves (saved_tensors_hooks), and published parameter counts.
"""

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from minimegatron.analysis import (REAL_MODELS, activation_memory, adam_bytes_per_parameter,
                                   count_parameters, does_it_fit, flops_per_token_6n,
                                   format_memory_report, korthikanti_activation_memory,
                                   measure_saved_activation_bytes, narayanan2021_flops_per_iteration,
                                   memory_report, real_model_config, training_flops,
                                   training_memory)
from minimegatron.config import ModelConfig
from minimegatron.model import GPTModel
from minimegatron.recompute import apply_recompute
from booktools.demo import import_chapter

plot_memory_breakdown = import_chapter("00", "make_figures").plot_memory_breakdown

# The formulas count the written-out ("naive") attention, whose matmuls FlopCounterMode and the
# saved-tensor hooks see one by one; cases that need the fused kernel say attention_backend="sdpa".
SMALL = dict(hidden_size=32, num_layers=2, num_attention_heads=4, max_position_embeddings=16,
             vocab_size=61, attention_backend="naive")
CONFIGS = {
    "gpt2": ModelConfig.gpt2(**SMALL),
    "gpt2-untied-nobias": ModelConfig.gpt2(**SMALL, untie_embeddings_and_output_weights=True,
                                           add_bias_linear=False),
    "llama-gqa": ModelConfig.llama(**SMALL, num_query_groups=2),
    "llama-mqa-tied": ModelConfig.llama(**SMALL, num_query_groups=1,
                                        untie_embeddings_and_output_weights=False),
    "llama-mha-bias": ModelConfig.llama(**SMALL, num_query_groups=4, add_bias_linear=True,
                                        ffn_hidden_size=40),
    "gpt2-swiglu-rmsnorm-gqa": ModelConfig.gpt2(**SMALL, num_query_groups=2, activation="swiglu",
                                                normalization="RMSNorm"),
}


def _with(cfg: ModelConfig, **kw) -> ModelConfig:
    return ModelConfig(**{**cfg.__dict__, **kw})


def _batch(cfg, b, s, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (b, s), generator=gen)
    labels = torch.randint(0, cfg.vocab_size, (b, s), generator=gen)
    return tokens, labels


# ---------------------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_parameter_count_equals_numel_of_the_real_model(name):
    cfg = CONFIGS[name]
    model = GPTModel(cfg)
    counts = count_parameters(cfg)
    assert counts["total"] == sum(p.numel() for p in model.parameters())

    # Component by component, from the parameter names.
    named = dict(model.named_parameters())

    def numel(suffix):
        return sum(p.numel() for n, p in named.items() if n.endswith(suffix))

    L, per_layer = cfg.num_layers, counts["per_layer"]
    for component, suffix in [("qkv_weight", "linear_qkv.weight"), ("qkv_bias", "linear_qkv.bias"),
                              ("proj_weight", "linear_proj.weight"), ("proj_bias", "linear_proj.bias"),
                              ("fc1_weight", "linear_fc1.weight"), ("fc1_bias", "linear_fc1.bias"),
                              ("fc2_weight", "linear_fc2.weight"), ("fc2_bias", "linear_fc2.bias")]:
        assert L * per_layer[component] == numel(suffix), component
    layer_norms = sum(p.numel() for n, p in named.items()
                      if "layernorm" in n and n.startswith("decoder.layers."))
    assert L * per_layer["norms"] == layer_norms
    assert counts["final_norm"] == numel("final_layernorm.weight") + numel("final_layernorm.bias")
    assert counts["embedding"] == numel("word_embeddings.weight")
    assert counts["position_embedding"] == numel("position_embeddings.weight")
    assert counts["output_layer"] == numel("output_layer.weight")
    # Kaplan's N is the same whether the output layer is tied or not.
    flipped = _with(cfg, untie_embeddings_and_output_weights=not cfg.untie_embeddings_and_output_weights)
    assert count_parameters(flipped)["non_embedding"] == counts["non_embedding"]


def test_parameter_counts_of_published_models():
    """Independent numbers: the published sizes of real checkpoints."""
    total = {name: count_parameters(real_model_config(name)[0])["total"] for name in REAL_MODELS}
    assert total["gpt2-small"] == 124_439_808            # Hugging Face "gpt2" (the 124M model)
    assert total["llama2-7b"] == 6_738_415_616           # Llama-2-7b
    assert total["llama2-70b"] == 68_976_648_192         # Llama-2-70b (GQA, g = 8)
    # GPT-3 (Brown et al. 2020, Table 2.1): "175.0B"; the exact count is 174.6B.
    assert abs(total["gpt3-175b"] - 174.6e9) < 0.05e9
    assert abs(total["gpt3-175b"] - 175e9) / 175e9 < 0.005
    # ... which is the textbook 12 L h^2 up to 0.4%.
    assert abs(total["gpt3-175b"] / (12 * 96 * 12288**2) - 1) < 0.004


# ---------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------

def _measure_flops(model, tokens, labels):
    with FlopCounterMode(display=False) as forward:
        loss = model(tokens, labels=labels).sum()
    with FlopCounterMode(display=False) as backward:
        loss.backward()
    return forward, backward


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_training_flops_match_flop_counter(name):
    cfg = CONFIGS[name]
    b, s = 3, 12
    model = GPTModel(cfg)
    forward, backward = _measure_flops(model, *_batch(cfg, b, s))
    flops = training_flops(cfg, b, s)
    assert forward.get_total_flops() == flops["forward"]["total"]
    assert backward.get_total_flops() == flops["backward"]["total"]
    assert flops["total"] == forward.get_total_flops() + backward.get_total_flops()

    # Per component, from the module the counter saw each matmul in.
    per_module = {name: sum(ops.values()) for name, ops in forward.get_flop_counts().items()}
    L, fwd = cfg.num_layers, flops["forward"]
    layer = "GPTModel.decoder.layers.0"
    assert per_module[f"{layer}.self_attention.linear_qkv"] * L == fwd["qkv"]
    assert per_module[f"{layer}.self_attention.linear_proj"] * L == fwd["proj"]
    assert per_module[f"{layer}.mlp.linear_fc1"] * L == fwd["fc1"]
    assert per_module[f"{layer}.mlp.linear_fc2"] * L == fwd["fc2"]
    bmm = sum(n for op, n in forward.get_flop_counts()[f"{layer}.self_attention"].items()
              if "bmm" in str(op))
    assert bmm * L == fwd["attention_scores"] + fwd["attention_over_values"]
    layers_total = sum(per_module[f"GPTModel.decoder.layers.{i}"] for i in range(L))
    assert per_module["GPTModel"] - layers_total == fwd["logits"]


def test_six_n_rule_is_what_is_left_without_attention_and_logits():
    """Measured FLOPs per token = 6 N (matrices only) + 12 L s h (attention) + 6 V h (logits)."""
    cfg = _with(CONFIGS["llama-gqa"], hidden_size=64, num_attention_heads=8)
    b, s = 2, 8
    forward, backward = _measure_flops(GPTModel(cfg), *_batch(cfg, b, s))
    per_token = (forward.get_total_flops() + backward.get_total_flops()) / (b * s)
    counts = count_parameters(cfg)
    per_layer = counts["per_layer"]
    not_multiplied = cfg.num_layers * (per_layer["norms"] + per_layer["qkv_bias"] + per_layer["proj_bias"]
                                       + per_layer["fc1_bias"] + per_layer["fc2_bias"]) + counts["final_norm"]
    attention = 12 * cfg.num_layers * s * cfg.num_attention_heads * cfg.kv_channels
    logits = 6 * cfg.vocab_size * cfg.hidden_size
    assert per_token == flops_per_token_6n(cfg) - 6 * not_multiplied + attention + logits
    assert flops_per_token_6n(cfg, include_embedding=True) == 6 * counts["total"]


def test_narayanan2021_formula_matches_measurement_with_and_without_recompute():
    """Narayanan et al. 2021: 72 (no recompute) and 96 (full recompute) B s L h^2 (...)."""
    cfg = CONFIGS["gpt2"]                       # the paper's model: g = a, f = 4h
    b, s = 2, 16
    tokens, labels = _batch(cfg, b, s)
    model = GPTModel(cfg)
    forward, backward = _measure_flops(model, tokens, labels)
    plain = forward.get_total_flops() + backward.get_total_flops()
    assert plain == narayanan2021_flops_per_iteration(cfg, b, s, recompute=False)

    # the book's full recompute (recompute.py), which reruns each whole layer, as Megatron does
    recomputed = apply_recompute(GPTModel(cfg), "full", "uniform", 1)
    with FlopCounterMode(display=False) as counter:
        recomputed(tokens, labels=labels).sum().backward()
    assert counter.get_total_flops() == narayanan2021_flops_per_iteration(cfg, b, s, recompute=True)
    h, L, V = cfg.hidden_size, cfg.num_layers, cfg.vocab_size
    assert counter.get_total_flops() == pytest.approx(96 * b * s * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h)))


# ---------------------------------------------------------------------------------------
# Parameters, gradients, optimizer state
# ---------------------------------------------------------------------------------------

def _tensor_bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def _adamw_state_bytes(optimizer):
    moments, steps = 0, []
    for state in optimizer.state.values():
        moments += _tensor_bytes([state["exp_avg"], state["exp_avg_sq"]])
        steps.append(state["step"])
    # torch also keeps one 0-d `step` counter per parameter tensor: not per-parameter memory.
    assert all(step.dim() == 0 for step in steps)
    return moments


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_params_grads_and_adamw_state_without_master_weights(name, dtype):
    cfg = _with(CONFIGS[name], params_dtype=dtype)
    model = GPTModel(cfg)
    tokens, labels = _batch(cfg, 2, 8)
    model(tokens, labels=labels).mean().backward()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.step()

    memory = training_memory(cfg, param_dtype=dtype, master_weights=False)
    assert memory["params"] == _tensor_bytes(model.parameters())
    assert memory["grads"] == _tensor_bytes(p.grad for p in model.parameters())
    assert memory["optimizer"] == _adamw_state_bytes(optimizer)
    assert memory["total"] == memory["params"] + memory["grads"] + memory["optimizer"]
    assert adam_bytes_per_parameter(dtype)["total"] == (16 if dtype == "float32" else 8)


def test_mixed_precision_is_sixteen_bytes_per_parameter():
    """bf16 model + fp32 master copy stepped by AdamW: ZeRO's 2 + 2 + 12 bytes."""
    cfg = _with(CONFIGS["llama-gqa"], params_dtype="bfloat16")
    model = GPTModel(cfg)
    tokens, labels = _batch(cfg, 2, 8)
    model(tokens, labels=labels).mean().backward()
    master = [p.detach().float().requires_grad_() for p in model.parameters()]
    for m, p in zip(master, model.parameters()):
        m.grad = p.grad.float()
    optimizer = torch.optim.AdamW(master, lr=1e-3)
    optimizer.step()

    memory = training_memory(cfg, param_dtype="bfloat16", master_weights=True)
    assert memory["params"] == _tensor_bytes(model.parameters())
    assert memory["grads"] == _tensor_bytes(p.grad for p in model.parameters())
    assert memory["master_weights"] == _tensor_bytes(master)
    assert memory["exp_avg"] + memory["exp_avg_sq"] == _adamw_state_bytes(optimizer)
    assert memory["total"] == 16 * memory["num_parameters"]
    per_param = adam_bytes_per_parameter("bfloat16", master_weights=True)
    assert (per_param["params"], per_param["grads"], per_param["optimizer"]) == (2, 2, 12)
    # fp32 gradients (Megatron's main_grad) make it 18.
    assert adam_bytes_per_parameter("bfloat16", True, grad_dtype="float32")["total"] == 18


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dp", [1, 3, 4])
def test_zero_stages_match_a_simulated_sharding(stage, dp):
    """Shard the flat parameter buffer over dp ranks as ZeRO does, and measure rank 0."""
    cfg = CONFIGS["gpt2"]
    model = GPTModel(cfg)
    tokens, labels = _batch(cfg, 2, 8)
    model(tokens, labels=labels).mean().backward()
    flat_params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    flat_grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    pad = (-flat_params.numel()) % dp                       # pad so that the dp shards are equal
    params_shard = torch.nn.functional.pad(flat_params, (0, pad)).chunk(dp)[0].clone()
    grads_shard = torch.nn.functional.pad(flat_grads, (0, pad)).chunk(dp)[0].clone()

    def adamw_state_after_one_step(param, grad):
        param = param.clone().requires_grad_()
        param.grad = grad
        optimizer = torch.optim.AdamW([param], lr=1e-3)
        optimizer.step()
        return _adamw_state_bytes(optimizer)

    memory = training_memory(cfg, zero_stage=stage, dp=dp)
    assert memory["optimizer"] == (adamw_state_after_one_step(params_shard, grads_shard) if stage >= 1
                                   else adamw_state_after_one_step(flat_params, flat_grads))
    assert memory["grads"] == _tensor_bytes([grads_shard if stage >= 2 else flat_grads])
    assert memory["params"] == _tensor_bytes([params_shard if stage >= 3 else flat_params])


def test_zero_paper_figure_1():
    """ZeRO's Figure 1: Psi = 7.5B parameters, dp = 64, K = 12 -> 120, 31.4, 16.6, 1.88 GB per
    device; that is 16, 4.19, 2.21, 0.25 bytes per parameter, whatever the model."""
    cfg, _ = real_model_config("llama2-7b")
    n = count_parameters(cfg)["total"]
    paper_gb = {0: 120, 1: 31.4, 2: 16.6, 3: 1.88}
    for stage, gb in paper_gb.items():
        memory = training_memory(cfg, param_dtype="bfloat16", master_weights=True, zero_stage=stage, dp=64)
        assert memory["total"] / n == pytest.approx(gb * 1e9 / 7.5e9, rel=0.01)


# ---------------------------------------------------------------------------------------
# Activations
# ---------------------------------------------------------------------------------------

class _SquareSine(torch.nn.Module):
    """A toy 'model' whose saved tensors are known by hand, to test the measurement itself."""

    def __init__(self, n):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(n))

    def forward(self, tokens, labels):
        u = tokens.float() * self.w        # saves tokens.float() (new, 4n B) and w (a parameter)
        v = u * u                          # saves u twice: one storage (4n B)
        z = v[:, :1].sin()                 # saves a view of v: v's whole storage (4n B)
        return z + self.w[:1].exp()        # exp saves its output: 4 B


def test_measurement_counts_storages_once_and_skips_parameters():
    tokens = torch.ones(3, 5, dtype=torch.long)
    assert measure_saved_activation_bytes(_SquareSine(5), tokens, None) == 3 * (3 * 5 * 4) + 4


def test_measurement_is_linear_in_batch_and_layers():
    cfg = CONFIGS["gpt2"]
    s = 8

    def measure(b, layers=cfg.num_layers):
        c = _with(cfg, num_layers=layers)
        return measure_saved_activation_bytes(GPTModel(c), *_batch(c, b, s))

    m2, m4, m8 = measure(2), measure(4), measure(8)
    assert m8 - m4 == 2 * (m4 - m2)                # linear in b...
    assert 1.95 < m4 / m2 <= 2.0                   # ...and doubling b nearly doubles it
    m1l, m2l, m3l = measure(2, 1), measure(2, 2), measure(2, 3)
    assert m3l - m2l == m2l - m1l > 0              # every layer saves the same


ACTIVATION_CASES = [
    # (config name, dtype, batch, seq, overrides)
    ("gpt2", "float32", 2, 12, {}),
    ("llama-gqa", "float32", 2, 12, {}),
    ("llama-mqa-tied", "float32", 3, 7, {}),
    ("llama-mha-bias", "float32", 2, 12, {}),
    ("gpt2-untied-nobias", "float32", 2, 12, {}),
    ("gpt2-swiglu-rmsnorm-gqa", "float32", 2, 12, {}),
    ("gpt2", "float64", 2, 12, {}),
    ("llama-gqa", "float64", 2, 12, {}),
    ("gpt2", "bfloat16", 2, 12, {}),
    ("llama-gqa", "bfloat16", 2, 12, {}),
    ("gpt2", "float32", 1, 12, {}),               # b = 1: q, k, v are views of the QKV output
    ("llama-mha-bias", "float32", 1, 12, {}),
    ("gpt2", "float32", 2, 12, dict(hidden_dropout=0.1, attention_dropout=0.1)),
    ("llama-gqa", "bfloat16", 2, 12, dict(hidden_dropout=0.1, attention_dropout=0.1)),
    ("gpt2", "float32", 2, 12, dict(attention_backend="sdpa")),
    ("llama-gqa", "bfloat16", 2, 12, dict(attention_backend="sdpa", hidden_dropout=0.1)),
    ("llama-mha-bias", "float32", 2, 12, dict(attention_backend="sdpa")),   # v: a view
    ("gpt2", "float32", 2, 12, dict(attention_backend="sdpa", num_query_groups=1)),  # q: a view
]


@pytest.mark.parametrize("name,dtype,b,s,overrides", ACTIVATION_CASES)
def test_activation_formula_matches_saved_tensors(name, dtype, b, s, overrides):
    cfg = _with(CONFIGS[name], params_dtype=dtype, **overrides)
    model = GPTModel(cfg)
    measured = measure_saved_activation_bytes(model, *_batch(cfg, b, s))
    assert activation_memory(cfg, b, s)["total"] == measured


def test_activation_per_layer_and_eval_mode():
    cfg = _with(CONFIGS["llama-gqa"], hidden_dropout=0.1, attention_dropout=0.1)
    b, s = 2, 12
    one, two = (measure_saved_activation_bytes(GPTModel(_with(cfg, num_layers=n)), *_batch(cfg, b, s))
                for n in (1, 2))
    assert activation_memory(cfg, b, s)["per_layer"]["total"] == two - one
    model = GPTModel(cfg).eval()                   # no dropout: no masks
    assert activation_memory(cfg, b, s, training=False)["total"] == \
        measure_saved_activation_bytes(model, *_batch(cfg, b, s))
    assert activation_memory(cfg, b, s, training=False)["total"] == \
        activation_memory(_with(cfg, hidden_dropout=0.0, attention_dropout=0.0), b, s)["total"]


def test_korthikanti_formula_and_the_documented_differences():
    """Measured bf16 GPT-2 layer with dropout = s b h (34 + 5 a s / h) + the differences the
    docstring of korthikanti_activation_memory lists, term by term."""
    cfg = _with(CONFIGS["gpt2"], params_dtype="bfloat16", hidden_dropout=0.1, attention_dropout=0.1)
    b, s, h, a = 2, 12, cfg.hidden_size, cfg.num_attention_heads
    one, two = (measure_saved_activation_bytes(GPTModel(_with(cfg, num_layers=n)), *_batch(cfg, b, s))
                for n in (1, 2))
    paper = korthikanti_activation_memory(cfg, b, s)["per_layer"]
    assert paper == 34 * s * b * h + 5 * a * s * s * b     # s b h (34 + 5 a s / h)
    differences = (2 * 2 * b * s * h          # two norms save an fp32 input: 4 bytes, not 2
                   + 2 * 2 * 4 * b * s        # ... and fp32 mean and rstd
                   + 2 * 2 * 4 * h            # ... and fp32 copies of weight and bias
                   + 2 * b * a * s * s        # the softmax output is fp32: 4 bytes, not 2
                   + s * s                    # the causal mask
                   + b * a * s * s            # CPU dropout masks are bf16 (2 bytes, not 1)...
                   + 2 * b * s * h)           # ... on the probabilities and on both residuals
    assert two - one == paper + differences
    gpu_like = activation_memory(cfg, b, s, dropout_mask_itemsize=1)["per_layer"]["total"]
    assert gpu_like == paper + differences - b * a * s * s - 2 * b * s * h


def test_activation_memory_rejects_what_it_does_not_model():
    cfg = _with(CONFIGS["gpt2"], attention_backend="sdpa", attention_dropout=0.1)
    with pytest.raises(ValueError, match="sdpa"):
        activation_memory(cfg, 2, 8)


# ---------------------------------------------------------------------------------------
# Reports, the figure, and why one device stops being enough
# ---------------------------------------------------------------------------------------

def test_memory_report_table_and_plot(tmp_path):
    cfg = CONFIGS["llama-gqa"]
    report = memory_report(cfg, 4, 16)
    assert report["total"] == report["params"] + report["grads"] + report["optimizer"] + report["activations"]
    assert report["activations"] == activation_memory(cfg, 4, 16)["total"]
    table = format_memory_report(report, "tiny llama")
    assert "optimizer" in table and f"{report['total']:,}" in table

    reports = {f"ZeRO-{k}": memory_report(cfg, 4, 16, zero_stage=k, dp=4) for k in range(4)}
    fig = plot_memory_breakdown(reports, tmp_path / "memory.png", device_memory_gib=1e-3, unit="GiB")
    assert (tmp_path / "memory.png").stat().st_size > 0
    bars = fig.axes[0].patches
    assert len(bars) == 4 * 4
    tops = {}
    for bar in bars:                                   # stacked: the top of the highest segment
        x = round(bar.get_x(), 6)
        tops[x] = max(tops.get(x, 0.0), bar.get_y() + bar.get_height())
    totals = [reports[k]["total"] / 2**30 for k in reports]
    assert [tops[x] for x in sorted(tops)] == pytest.approx(totals)
    tallest = max(r["total"] for r in reports.values())             # unit="auto"
    assert plot_memory_breakdown(reports).axes[0].get_ylabel() == ("MiB" if tallest >= 2**20 else "KiB")


def test_gpt3_does_not_fit_one_80gb_gpu():
    verdict = does_it_fit("gpt3-175b", device_memory_gib=80)
    n = verdict["num_parameters"]
    assert not verdict["fits"]
    assert verdict["params"] + verdict["grads"] + verdict["optimizer"] == 16 * n     # ZeRO's 16 B
    assert 16 * n / 2**30 > 32 * 80                   # the states alone: more than 32 GPUs
    assert verdict["devices_needed"] >= 33
    assert "does NOT fit" in verdict["table"]
    assert does_it_fit("gpt2-small")["fits"]


def test_exercise_marker_is_well_formed():
    from pathlib import Path

    import minimegatron.analysis.memory as memory_module
    from booktools.exercises.markers import find_exercises

    path = Path(memory_module.__file__)
    exercises = find_exercises(path.read_text(), path, "minimegatron.analysis.memory")
    assert [(ex.id, ex.function) for ex in exercises] == [("0.3", "adam_bytes_per_parameter")]


@pytest.mark.parametrize("dtype,master,expected", [("float32", False, 16), ("bfloat16", True, 16),
                                                   ("bfloat16", False, 8), ("float64", False, 32)])
def test_adam_bytes_per_parameter_table(dtype, master, expected):
    per_param = adam_bytes_per_parameter(dtype, master)
    assert per_param["total"] == expected
    assert per_param["total"] == per_param["params"] + per_param["grads"] + per_param["optimizer"]
    assert per_param["optimizer"] == per_param["master_weights"] + per_param["exp_avg"] + per_param["exp_avg_sq"]
    assert math.isclose(per_param["exp_avg"], 4 if master else torch.empty((), dtype=getattr(torch, dtype)).element_size())
