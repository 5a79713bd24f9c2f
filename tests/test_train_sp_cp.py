"""The training loop under sequence and context parallelism (chapter 04): TP+SP x CP, CP x DP
with ZeRO-1, hierarchical CP, CP x PP train the same model as the single-device loop (same
global batch, clipping on every step), resume bit for bit from their per-rank checkpoints,
and a checkpoint of another cp size is refused by name."""

import pytest
import torch

from minimegatron.launch import spawn
from minimegatron.config import ModelConfig, TrainConfig
from minimegatron.model import GPTModel
from minimegatron.train import train

MODEL = ModelConfig.llama(hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                          max_position_embeddings=16, params_dtype="float64")    # RoPE: positions follow tokens
CLIP = 0.05
LAYOUTS = {   # name -> (micro-batch size per data-parallel replica, overrides); all on 4 ranks
    "tp2sp-cp2-p2p": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True, context_parallel_size=2)),
    "cp2-dp2-all_gather-zero1": (1, dict(context_parallel_size=2, cp_comm_type="all_gather", zero_stage=1)),
    "cp2-pp2-a2a": (2, dict(context_parallel_size=2, cp_comm_type="a2a", pipeline_model_parallel_size=2)),
}


def _cfg(tmp, name, **kw) -> TrainConfig:
    base = dict(seq_length=16, micro_batch_size=2, grad_accum_steps=2, train_iters=4, lr_warmup_iters=1,
                eval_interval=2, eval_iters=1, clip_grad=CLIP, progress=False, out_dir=str(tmp / name / "out"))
    return TrainConfig(**{**base, **kw})


# dropout under SP draws per-rank masks from the tracker (tp/random.py): no single-device
# equivalence, but the run must still repeat itself exactly when resumed
DROPOUT = ModelConfig.llama(**{**MODEL.__dict__, "hidden_dropout": 0.1})


def _worker(tmp) -> dict:
    out = {}
    for name, (mbs, extra) in [*LAYOUTS.items(), ("tp2sp-cp2-dropout", LAYOUTS["tp2sp-cp2-p2p"])]:
        model = DROPOUT if name.endswith("dropout") else MODEL
        full = train(model, _cfg(tmp, name + "-full", micro_batch_size=mbs, **extra))
        ckpt = tmp / name / "ckpt"
        train(model, _cfg(tmp, name + "-first", micro_batch_size=mbs, save_dir=str(ckpt), save_interval=2, **extra))
        if torch.distributed.get_rank() == 0:
            (ckpt / "latest").write_text("iter_0000002.pt\n")
        torch.distributed.barrier()
        resumed = train(model, _cfg(tmp, name + "-resumed", micro_batch_size=mbs, load_dir=str(ckpt), **extra))
        out[name] = (full.losses, full.eval_losses, resumed.losses, resumed.eval_losses)
    try:                                                   # cp 2 x dp 2 resumed as cp 4: the same 4 ranks
        train(MODEL, _cfg(tmp, "other-cp", micro_batch_size=1, context_parallel_size=4,
                          load_dir=str(tmp / "cp2-dp2-all_gather-zero1" / "ckpt")))
        out["error"] = "no error"
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


@pytest.mark.slow
def test_sp_and_cp_training_loops_match_one_device_and_resume_exactly(tmp_path):
    # the same global batch on one device: 2 sequences x 2 micro-batches
    reference = train(MODEL, _cfg(tmp_path, "single"))
    per_rank = spawn(_worker, 4, tmp_path, timeout=500)
    assert all(r == per_rank[0] for r in per_rank)          # every rank reports the same numbers
    for name in LAYOUTS:
        full, full_eval, resumed, resumed_eval = per_rank[0][name]
        assert (resumed, resumed_eval) == (full, full_eval), name          # bit for bit
        diff = max(abs(a - b) for a, b in zip(full, reference.losses))
        assert diff < 1e-10, (name, diff)
        assert max(abs(a[1] - b[1]) for a, b in zip(full_eval, reference.eval_losses)) < 1e-10, name
        state = torch.load(tmp_path / name / "ckpt" / "iter_0000004.pt", weights_only=True)
        GPTModel(MODEL).load_state_dict(state["model"])     # single-device names and shapes
    full, _, resumed, _ = per_rank[0]["tp2sp-cp2-dropout"]
    assert resumed == full and abs(full[0] - reference.losses[0]) > 1e-6     # dropout did act, and repeats
    assert "CheckpointError" in per_rank[0]["error"] and "cp_size=2" in per_rank[0]["error"], per_rank[0]["error"]
    # counted as the banner counts (Megatron's dp excludes cp): not "dp_size=4 (cp_size=2)"
    assert "written by 4 ranks: tp_size=1 x cp_size=2 x pp_size=1 x data-parallel size 2; this run has 4 ranks: " \
           "tp_size=1 x cp_size=4 x pp_size=1 x data-parallel size 1" in per_rank[0]["error"], per_rank[0]["error"]
