"""The training loop under pipeline parallelism (chapter 03): PP x DP (interleaved; with ZeRO-1,
and 1F1B with ZeRO-2: the distributed optimizer over every chunk, the tied embedding in a bucket
of its own on both stages) and TP x PP train the same model as the single-device loop (same global batch, clipping active on every
step), resume bit for bit from their per-rank checkpoints, write a main checkpoint that loads
into the single-device model, and bad layouts stop before training."""

import pytest
import torch

from minimegatron.config import ConfigError, ModelConfig, TrainConfig
from minimegatron.launch import spawn
from minimegatron.model import GPTModel
from minimegatron.parallelize import validate_layout
from minimegatron.train import train

MODEL = ModelConfig.gpt2(hidden_size=32, num_layers=4, num_attention_heads=4, max_position_embeddings=16,
                         params_dtype="float64")               # tied embeddings: first and last stage
CLIP = 0.05
LAYOUTS = {   # name -> (micro-batch size per DP rank, train config overrides); all on 4 ranks
    "pp2xdp2-interleaved": (1, dict(pipeline_model_parallel_size=2, pipeline_schedule="interleaved",
                                    num_virtual_stages_per_pipeline_rank=2)),
    "pp2xdp2-interleaved-zero1": (1, dict(pipeline_model_parallel_size=2, pipeline_schedule="interleaved",
                                          num_virtual_stages_per_pipeline_rank=2, zero_stage=1)),
    "pp2xdp2-1f1b-zero2": (1, dict(pipeline_model_parallel_size=2, zero_stage=2)),
    "tp2xpp2-1f1b": (2, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)),
    "pp4-gpipe": (2, dict(pipeline_model_parallel_size=4, pipeline_schedule="gpipe")),
}


def _cfg(tmp, name, **kw) -> TrainConfig:
    base = dict(seq_length=16, micro_batch_size=2, grad_accum_steps=4, train_iters=6, lr_warmup_iters=2,
                eval_interval=3, eval_iters=1, clip_grad=CLIP, progress=False, out_dir=str(tmp / name / "out"))
    return TrainConfig(**{**base, **kw})


def _worker(tmp) -> dict:
    out = {}
    for name, (mbs, extra) in LAYOUTS.items():
        full = train(MODEL, _cfg(tmp, name + "-full", micro_batch_size=mbs, **extra))
        ckpt = tmp / name / "ckpt"
        train(MODEL, _cfg(tmp, name + "-first", micro_batch_size=mbs, save_dir=str(ckpt), save_interval=3, **extra))
        if torch.distributed.get_rank() == 0:
            (ckpt / "latest").write_text("iter_0000003.pt\n")
        torch.distributed.barrier()
        resumed = train(MODEL, _cfg(tmp, name + "-resumed", micro_batch_size=mbs, load_dir=str(ckpt), **extra))
        out[name] = (full.losses, full.eval_losses, resumed.losses, resumed.eval_losses)
    try:
        train(MODEL, _cfg(tmp, "bad-layout", pipeline_model_parallel_size=4,
                          load_dir=str(tmp / "tp2xpp2-1f1b" / "ckpt")))
        out["error"] = "no error"
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


@pytest.mark.slow
def test_pipeline_training_loop_matches_one_device_and_resumes_exactly(tmp_path):
    # the same global batch on one device: 2 sequences x 4 micro-batches (x dp)
    references = {name: train(MODEL, _cfg(tmp_path, "single-" + name, micro_batch_size=2))
                  for name in LAYOUTS}
    per_rank = spawn(_worker, 4, tmp_path, timeout=400)
    assert all(r == per_rank[0] for r in per_rank)          # every rank reports the same numbers
    for name in LAYOUTS:
        full, full_eval, resumed, resumed_eval = per_rank[0][name]
        assert (resumed, resumed_eval) == (full, full_eval), name          # bit for bit
        diff = max(abs(a - b) for a, b in zip(full, references[name].losses))
        assert diff < 1e-10, (name, diff)
        assert max(abs(a[1] - b[1]) for a, b in zip(full_eval, references[name].eval_losses)) < 1e-10
        state = torch.load(tmp_path / name / "ckpt" / "iter_0000006.pt", weights_only=True)
        GPTModel(MODEL).load_state_dict(state["model"])     # every stage's part, single-device names
    assert "CheckpointError" in per_rank[0]["error"] and "pp_size=2" in per_rank[0]["error"], per_rank[0]["error"]


def test_bad_pipeline_configs_are_refused_before_training():
    """parallelize.validate_layout, which train() runs before any process group exists."""
    with pytest.raises(ConfigError, match="num_layers=4 is not divisible by pipeline_model_parallel_size=3"):
        validate_layout(MODEL, TrainConfig(seq_length=16, pipeline_model_parallel_size=3, grad_accum_steps=3), 3)
    with pytest.raises(ConfigError, match="grad_accum_steps=3 micro-batches: .*multiple of pp_size=2"):
        validate_layout(MODEL, TrainConfig(seq_length=16, pipeline_model_parallel_size=2,
                                           pipeline_schedule="interleaved", grad_accum_steps=3,
                                           num_virtual_stages_per_pipeline_rank=2), 2)
    with pytest.raises(ConfigError, match="zero_stage=3 with pipeline_model_parallel_size=2"):
        validate_layout(MODEL, TrainConfig(seq_length=16, pipeline_model_parallel_size=2, zero_stage=3), 2)
    for stage in (1, 2):                         # ZeRO-1 and ZeRO-2 run with a pipeline
        validate_layout(MODEL, TrainConfig(seq_length=16, pipeline_model_parallel_size=2, zero_stage=stage), 4)
    with pytest.raises(ConfigError, match="world size 1 is not divisible by .*pipeline_model_parallel_size=2"):
        train(MODEL, TrainConfig(seq_length=16, pipeline_model_parallel_size=2, train_iters=1, lr_warmup_iters=0,
                                 progress=False))
