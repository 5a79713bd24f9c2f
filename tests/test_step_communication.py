"""analysis/communication.py against the ledger of real steps: in one world of 4 ranks, thirteen
layouts that between them take every branch of its formulas (chapter 06's precisions too) (tensor parallelism with and
without SP, tied GPT-2 embeddings with learned positions and biases, pipelines (interleaved too), the three
context-parallel comm types, both token dispatchers, etp, the auxiliary loss per token set and
per sequence, the expert bias). Each rank's parameters must equal rank_parameters, and
run_report.communication_checks must find nothing (every record of every dimension the
formula's, the gradient reductions each gradient once, the dispatcher's sums agreeing)."""

from __future__ import annotations

import pytest

from minimegatron.config import ModelConfig, TrainConfig
from minimegatron.launch import spawn
from minimegatron.run_report import communication_checks
from workers.step_communication import measure_layouts   # tests/workers/step_communication.py


def _layout(name, style="llama", layers=2, tp=1, cp=1, pp=1, dp=1, sp=False, cp_comm_type="p2p", experts=None,
            ep=1, etp=None, dispatcher="alltoall", batch=1, chunks=1, precision={}, **moe):
    model = getattr(ModelConfig, style)(hidden_size=32, num_layers=layers, num_attention_heads=4, num_query_groups=2,
                                        ffn_hidden_size=64, vocab_size=60, max_position_embeddings=64,
                                        params_dtype="bfloat16" if precision.get("bf16") else "float32",
                                        **({"num_experts": experts, "moe_router_topk": 2, **moe} if experts else {}))
    cfg = TrainConfig(seq_length=16, micro_batch_size=batch, grad_accum_steps=2, train_iters=1, lr_warmup_iters=0,
                      progress=False, eval_interval=0, tensor_model_parallel_size=tp, context_parallel_size=cp,
                      pipeline_model_parallel_size=pp, sequence_parallel=sp, cp_comm_type=cp_comm_type,
                      expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                      moe_token_dispatcher_type=dispatcher, num_virtual_stages_per_pipeline_rank=chunks,
                      pipeline_schedule="interleaved" if chunks > 1 else "1f1b", **precision)
    assert tp * cp * pp * dp == 4
    return name, model, cfg, dp


LAYOUTS = [
    _layout("tp2 dp2, GPT-2 (tied, learned positions, biases)", "gpt2", tp=2, dp=2),
    _layout("tp2 sp pp2, GPT-2", "gpt2", tp=2, sp=True, pp=2),
    _layout("cp4 all_gather", cp=4, cp_comm_type="all_gather"),
    _layout("pp2 dp2 interleaved, 2 chunks per rank, GPT-2 (tied)", "gpt2", layers=4, pp=2, dp=2, chunks=2),
    _layout("cp2 a2a dp2", cp=2, dp=2, cp_comm_type="a2a"),
    _layout("tp2 sp cp2 p2p", tp=2, sp=True, cp=2),
    _layout("tp2 sp dp2, ep2 etp1, allgather dispatcher, aux loss", layers=1, tp=2, sp=True, dp=2, experts=4, ep=2,
            etp=1, dispatcher="allgather", moe_aux_loss_coeff=1e-2),
    _layout("tp2 sp dp2, ep2 etp2, aux loss", tp=2, sp=True, dp=2, experts=4, ep=2, etp=2, moe_aux_loss_coeff=1e-2),
    _layout("pp2 dp2, ep2, expert bias", pp=2, dp=2, experts=4, ep=2, moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True),
    _layout("cp2 dp2, ep2, sequence aux loss", cp=2, dp=2, experts=4, ep=2, batch=2, moe_aux_loss_coeff=1e-2,
            moe_router_load_balancing_type="seq_aux_loss"),
    # chapter 06: float32 main gradients beside bf16 parameters (the SP norms' and the tied
    # embedding's reductions), the loss's float32 all-reduces, and FP8's amax reductions
    _layout("bf16 tp2 sp pp2, GPT-2 (tied)", "gpt2", tp=2, sp=True, pp=2, precision={"bf16": True}),
    _layout("bf16 + FP8 delayed, tp2 sp cp2", tp=2, sp=True, cp=2,
            precision={"bf16": True, "fp8_format": "hybrid", "fp8_recipe": "delayed"}),
    _layout("FP8 tensorwise, tp2 sp dp2, ep2 etp2, shared expert", tp=2, sp=True, dp=2, experts=4, ep=2, etp=2,
            moe_shared_expert_intermediate_size=32, precision={"fp8_format": "hybrid", "fp8_recipe": "tensorwise"}),
]


@pytest.fixture(scope="module")
def measured():
    return spawn(measure_layouts, 4, LAYOUTS, timeout=600)


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=[name for name, *_ in LAYOUTS])
def test_each_rank_holds_and_moves_what_the_formulas_say(measured, index):
    name, model, cfg, _ = LAYOUTS[index]
    per_rank = [rank[index] for rank in measured]
    for rank, r in enumerate(per_rank):
        assert r["params"] == r["formula_params"], (name, rank, r["params"], r["formula_params"])
    problems = {dim: found for dim, found in communication_checks(model, cfg, per_rank).items() if found}
    assert not problems, (name, problems)
    dims = {d for r in per_rank for d in r["records"]}
    assert dims - {"loss and norm"}, f"{name}: nothing recorded"          # the layout did communicate


def test_a_dropped_record_is_found(measured):
    """The check can fail: the same records less one all-gather of one rank of the SP layout."""
    index = next(i for i, (name, *_) in enumerate(LAYOUTS) if name == "tp2 sp cp2 p2p")
    name, model, cfg, _ = LAYOUTS[index]
    per_rank = [dict(rank[index]) for rank in measured]
    tp = per_rank[1]["records"]["tp"] = per_rank[1]["records"]["tp"].copy()
    tp[next(key for key in tp if key[0] == "all_gather")] -= 1
    assert communication_checks(model, cfg, per_rank)["tp"][0].startswith("rank 1: unexpected {}, missing")
