"""The training loop under data parallelism: every variant of chapter 01 trains the same model
as the single-device loop (same global batch), and resumes exactly from its checkpoints."""

import dataclasses

import pytest
import torch

from minimegatron.config import ModelConfig, TrainConfig
from minimegatron.launch import spawn
from minimegatron.train import train

MODEL = ModelConfig.llama(hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                          max_position_embeddings=16, params_dtype="float64")
VARIANTS = [dict(zero_stage=0, ddp_impl="naive"), dict(zero_stage=0, ddp_impl="bucketed", ddp_bucket_size=4000),
            dict(zero_stage=1), dict(zero_stage=2), dict(zero_stage=3)]


def _cfg(tmp, name, **kw) -> TrainConfig:
    base = dict(seq_length=16, micro_batch_size=2, grad_accum_steps=2, train_iters=6, lr_warmup_iters=2,
                eval_interval=3, eval_iters=1, progress=False, out_dir=str(tmp / name / "out"))
    return TrainConfig(**{**base, **kw})


def _variants_worker(tmp) -> dict:
    """On every rank: each variant trains 6 steps uninterrupted, and again stopped at 3 and resumed."""
    out = {}
    for i, variant in enumerate(VARIANTS):
        name = f"v{i}"
        full = train(MODEL, _cfg(tmp, name + "-full", **variant))
        ckpt = tmp / name / "ckpt"
        train(MODEL, _cfg(tmp, name + "-first", train_iters=6, save_dir=str(ckpt), save_interval=3, **variant))
        # resume from step 3: point `latest` back at it (rank 0 only; then everyone reads it)
        if torch.distributed.get_rank() == 0:
            (ckpt / "latest").write_text("iter_0000003.pt\n")
        torch.distributed.barrier()
        resumed = train(MODEL, _cfg(tmp, name + "-resumed", load_dir=str(ckpt), **variant))
        out[name] = (full.losses, full.eval_losses, resumed.losses, resumed.eval_losses)
    return out


@pytest.mark.slow
def test_every_dp_variant_trains_like_one_device_and_resumes_exactly(tmp_path):
    # One device, same global batch: micro-batch 2 x 2 ranks = 4 sequences per micro-batch.
    reference = train(MODEL, _cfg(tmp_path, "single", micro_batch_size=4))
    per_rank = spawn(_variants_worker, 2, tmp_path, timeout=600)
    assert per_rank[0] == per_rank[1]                      # every rank reports the same losses
    for i, variant in enumerate(VARIANTS):
        full, full_eval, resumed, resumed_eval = per_rank[0][f"v{i}"]
        assert resumed == full and resumed_eval == full_eval, variant   # exact resume, bit for bit
        assert len(full) == len(reference.losses)
        diff = max(abs(a - b) for a, b in zip(full, reference.losses))
        assert diff < 1e-10, (variant, diff)               # float64: the single-device run


def test_resuming_with_another_number_of_ranks_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    train(MODEL, _cfg(tmp_path, "one", train_iters=2, save_dir=str(ckpt)))
    with pytest.raises(Exception, match="written by 1 rank: .* x data-parallel size 1; this run has 2 ranks: .* x "
                                        "data-parallel size 2"):
        spawn(train, 2, MODEL, dataclasses.replace(_cfg(tmp_path, "two", train_iters=4), load_dir=str(ckpt)),
              timeout=120)
