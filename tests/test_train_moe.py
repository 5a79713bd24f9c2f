"""The training loop trains a GPT-MoE under expert parallelism (chapter 05): TP+SP x EP x
expert-DP with the expert bias and a shared expert trains the same model as the single-device
loop (whose micro-batches are the data replicas' own: each is one token set of the
load-balancing loss), resume bit for bit from their per-rank checkpoints (the expert bias
included), and a checkpoint of another ep size is refused by name."""

import pytest
import torch

from minimegatron.launch import spawn
from minimegatron.config import ModelConfig, TrainConfig
from minimegatron.model import GPTModel
from minimegatron.train import train

MODEL = ModelConfig.llama(hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                          max_position_embeddings=16, params_dtype="float64", num_experts=4, moe_router_topk=2,
                          moe_ffn_hidden_size=32, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3,
                          moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                          moe_router_bias_update_rate=1e-2, moe_shared_expert_intermediate_size=32)
CLIP = 0.05
LAYOUTS = {   # name -> (model, data replicas, overrides); on 4 ranks: experts unsplit, expert-dp 2
    "tp2sp-ep2-bias-shared": (MODEL, 2, dict(tensor_model_parallel_size=2, sequence_parallel=True,
                                              expert_model_parallel_size=2, expert_tensor_parallel_size=1)),
}


def _cfg(tmp, name, **kw) -> TrainConfig:
    base = dict(seq_length=16, micro_batch_size=1, grad_accum_steps=2, train_iters=4, lr_warmup_iters=1,
                eval_interval=2, eval_iters=1, clip_grad=CLIP, progress=False, out_dir=str(tmp / name / "out"))
    return TrainConfig(**{**base, **kw})


def _worker(tmp) -> dict:
    out = {}
    for name, (model, _, extra) in LAYOUTS.items():
        full = train(model, _cfg(tmp, name + "-full", **extra))
        ckpt = tmp / name / "ckpt"
        train(model, _cfg(tmp, name + "-first", save_dir=str(ckpt), save_interval=1, **extra))
        if torch.distributed.get_rank() == 0:
            (ckpt / "latest").write_text("iter_0000002.pt\n")
        torch.distributed.barrier()
        resumed = train(model, _cfg(tmp, name + "-resumed", load_dir=str(ckpt), **extra))
        out[name] = (full.losses, full.eval_losses, resumed.losses, resumed.eval_losses)
    try:                                                   # ep 2 resumed as ep 4: the same 4 ranks
        train(MODEL, _cfg(tmp, "other-ep", **{**LAYOUTS["tp2sp-ep2-bias-shared"][2], "expert_model_parallel_size": 4},
                          load_dir=str(tmp / "tp2sp-ep2-bias-shared" / "ckpt")))
        out["error"] = "no error"
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


@pytest.mark.slow
def test_moe_training_loops_match_one_device_and_resume_exactly(tmp_path):
    per_rank = spawn(_worker, 4, tmp_path, timeout=500)
    assert all(r == per_rank[0] for r in per_rank)          # every rank reports the same numbers
    for name, (model, replicas, _) in LAYOUTS.items():
        # one device: the replicas' micro-batches one after the other, each its own token set
        reference = train(model, _cfg(tmp_path, name + "-single", grad_accum_steps=2 * replicas))
        full, full_eval, resumed, resumed_eval = per_rank[0][name]
        assert (resumed, resumed_eval) == (full, full_eval), name          # bit for bit
        diff = max(abs(a - b) for a, b in zip(full, reference.losses))
        assert diff < 1e-10, (name, diff)
        # (validation: each replica evaluates its own micro-batch, the one device micro_batch_size of
        # them: other sequences, so only the resume is compared there, above)
        state = torch.load(tmp_path / name / "ckpt" / "iter_0000004.pt", weights_only=True)
        GPTModel(model).load_state_dict(state["model"])     # single-device names and shapes, with the bias
    # after one step each bias entry is rate x sign(mean count - its count): -rate, 0 or +rate, not all 0
    # unless every expert got exactly the mean (later steps may cancel it out again)
    saved = torch.load(tmp_path / "tp2sp-ep2-bias-shared" / "ckpt" / "iter_0000001.pt", weights_only=True)["model"]
    rate = MODEL.moe_router_bias_update_rate
    for i in range(2):
        bias = saved[f"decoder.layers.{i}.mlp.router.expert_bias"]
        assert all(v == 0 or abs(abs(v) - rate) < 1e-6 for v in bias.tolist()) and bias.abs().max() > 0, bias
    assert "CheckpointError" in per_rank[0]["error"] and "expert_model_parallel_size" in per_rank[0]["error"], \
        per_rank[0]["error"]
