"""The training loop under tensor x data parallelism (chapter 02): TP=2 x DP=2 (with the DP of
chapter 01: replicated, ZeRO-1, ZeRO-2, ZeRO-3) and TP=4 x DP=1 train the same model as the
single-device loop (same global batch, gradient clipping active; LLaMA untied and GPT-2 tied;
float64 and float32; hidden dropout), resume bit for bit from their checkpoints (also with
ZeRO's sharded optimizer state and the per-rank attention-dropout stream), and bad layouts
stop before training."""

import pytest
import torch

from minimegatron.config import ConfigError, ModelConfig, TrainConfig
from minimegatron.launch import spawn
from minimegatron.model import GPTModel
from minimegatron.parallelize import validate_layout
from minimegatron.train import train

# 4 heads in 4 groups (splits over tp 4); the vocabulary of 256 byte ids splits too
MODEL = ModelConfig.llama(hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=4,
                          max_position_embeddings=16,
                          params_dtype="float64")
GQA = ModelConfig.llama(hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                        max_position_embeddings=16, params_dtype="float64")
GPT2_TIED = ModelConfig.gpt2(hidden_size=32, num_layers=2, num_attention_heads=4, max_position_embeddings=16,
                             params_dtype="float64")
FP32 = ModelConfig(**{**MODEL.__dict__, "params_dtype": "float32"})
CLIP = 0.05          # well below the gradient norm of this model (~0.5-2): every step clips

# name -> (tp, model, train config overrides, resume too?, the single-device run to equal)
# "equal": the single-device losses within the dtype's tolerance; with attention dropout the
# heads' masks come from per-TP-rank streams (as they must), so only consistency and resume.
LAYOUTS = {
    "tp2xdp2": (2, MODEL, {}, True, "equal"),
    "tp4xdp1": (4, MODEL, {}, True, "equal"),
    "tp2xdp2-zero1": (2, MODEL, {"zero_stage": 1, "ddp_bucket_size": 3000}, True, "equal"),
    "tp2xdp2-zero2-gpt2-tied": (2, GPT2_TIED, {"zero_stage": 2}, False, "equal"),
    "tp2xdp2-zero3-gpt2-tied": (2, GPT2_TIED, {"zero_stage": 3}, True, "equal"),
    "tp2xdp2-float32": (2, FP32, {"adam_eps": 1e-5}, False, "equal"),
    # tp 4 x dp 1 draws hidden-dropout masks of the single device's shape from the same seed
    "tp4xdp1-hidden-dropout": (4, ModelConfig(**{**MODEL.__dict__, "hidden_dropout": 0.2}), {}, False, "equal"),
    "tp2xdp2-attention-dropout": (2, ModelConfig(**{**MODEL.__dict__, "attention_dropout": 0.2}), {}, True,
                                  "resume only"),
}
TOLERANCE = {"float64": 1e-10, "float32": 2e-5}


def _cfg(tmp, name, **kw) -> TrainConfig:
    base = dict(seq_length=16, micro_batch_size=2, grad_accum_steps=2, train_iters=6, lr_warmup_iters=2,
                eval_interval=3, eval_iters=1, clip_grad=CLIP, zero_stage=0, progress=False,
                out_dir=str(tmp / name / "out"))
    return TrainConfig(**{**base, **kw})


def _worker(tmp) -> dict:
    """On each of 4 ranks: every layout trains 6 steps (and, where asked, again stopped at 3 and
    resumed); then the bad layouts, whose errors are returned as text."""
    out = {}
    for name, (tp, model, extra, resume, _) in LAYOUTS.items():
        full = train(model, _cfg(tmp, name + "-full", tensor_model_parallel_size=tp, **extra))
        resumed = None
        if resume:
            ckpt = tmp / name / "ckpt"
            train(model, _cfg(tmp, name + "-first", tensor_model_parallel_size=tp, save_dir=str(ckpt),
                              save_interval=3, **extra))
            if torch.distributed.get_rank() == 0:
                (ckpt / "latest").write_text("iter_0000003.pt\n")
            torch.distributed.barrier()
            resumed = train(model, _cfg(tmp, name + "-resumed", tensor_model_parallel_size=tp, load_dir=str(ckpt),
                                        **extra))
            resumed = (resumed.losses, resumed.eval_losses)
        out[name] = (full.losses, full.eval_losses, resumed)
    errors = {}
    for what, model, tp, extra in (("world", MODEL, 3, {}), ("groups", GQA, 4, {}),
                                   ("layout", MODEL, 4, {"load_dir": str(tmp / "tp2xdp2" / "ckpt")})):
        try:
            train(model, _cfg(tmp, "bad-" + what, tensor_model_parallel_size=tp, **extra))
            errors[what] = "no error"
        except Exception as exc:                 # ConfigError / CheckpointError, on every rank
            errors[what] = f"{type(exc).__name__}: {exc}"
    out["errors"] = errors
    return out


@pytest.mark.slow
def test_tensor_x_data_parallel_trains_like_one_device_and_resumes_exactly(tmp_path):
    # One device, same global batch: micro-batch 2 x dp 2 = 4 sequences (tp 4 x dp 1: 2).
    reference = {name: train(model, _cfg(tmp_path, "single-" + name, micro_batch_size=2 * (4 // tp),
                                         **{k: v for k, v in extra.items() if k != "ddp_bucket_size"}))
                 for name, (tp, model, extra, _, how) in LAYOUTS.items() if how == "equal"}
    per_rank = spawn(_worker, 4, tmp_path, timeout=400)
    assert all(r == per_rank[0] for r in per_rank)          # every rank reports the same losses
    for name, (tp, model, extra, resume, how) in LAYOUTS.items():
        full, full_eval, resumed = per_rank[0][name]
        assert len(full) == 6
        if resume:
            assert resumed == (full, full_eval), name        # exact resume, bit for bit
        if how != "equal":
            continue
        tol = TOLERANCE[model.params_dtype]
        diff = max(abs(a - b) for a, b in zip(full, reference[name].losses))
        assert diff < tol, (name, diff)                     # the single-device run
        eval_diff = max(abs(a[1] - b[1]) for a, b in zip(full_eval, reference[name].eval_losses))
        assert eval_diff < tol, (name, eval_diff)
    # attention dropout changes the run (it is on), but every rank reported the same losses
    assert per_rank[0]["tp2xdp2-attention-dropout"][0] != per_rank[0]["tp2xdp2"][0]
    # the main checkpoint file holds the single-device model, gathered from the shards
    state = torch.load(tmp_path / "tp2xdp2" / "ckpt" / "iter_0000006.pt", weights_only=True)
    assert state["tp_size"] == 2 and state["dp_size"] == 2
    GPTModel(MODEL).load_state_dict(state["model"])
    errors = per_rank[0]["errors"]
    assert "ConfigError" in errors["world"] and "world size 4" in errors["world"] \
        and "tensor_model_parallel_size=3" in errors["world"], errors["world"]
    assert "ConfigError" in errors["groups"] and "num_query_groups=2" in errors["groups"] \
        and "tp=4" in errors["groups"], errors["groups"]
    assert "CheckpointError" in errors["layout"] and "tp_size=2 x cp_size=1 x pp_size=1 x data-parallel size 2" \
        in errors["layout"], errors["layout"]


def test_bad_tensor_parallel_configs_are_refused_before_training():
    with pytest.raises(ConfigError, match="sequence_parallel with zero_stage=3"):
        validate_layout(MODEL, TrainConfig(seq_length=16, tensor_model_parallel_size=2, zero_stage=3,
                                           sequence_parallel=True), 4)
    with pytest.raises(ConfigError, match="tensor_model_parallel_size=0"):
        TrainConfig(tensor_model_parallel_size=0).validate()
    with pytest.raises(ConfigError, match="world size 1 is not divisible by tensor_model_parallel_size=2"):
        train(MODEL, TrainConfig(seq_length=16, tensor_model_parallel_size=2, train_iters=1, lr_warmup_iters=0,
                                 progress=False))
