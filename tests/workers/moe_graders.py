"""Rank functions for the graders of chapter 05 (mixture of experts, expert parallelism),
tests/graders/test_ch05_ep_moe.py.

One spawned world of 4 ranks grades the two exercises that need ranks (a rank costs seconds to
start; booktools/exercises/world.py: only the exercises being graded, each failure charged to its
own exercise): the rank runs each exercise's checks with that exercise's function plugged in
(`plug(id)`: the learner's, the reference or the bare stub, from MINIMEGATRON_IMPL) and records,
per exercise, either the plain data the checks produced or the traceback that stopped them. The
graders compare the data in the parent against independent oracles (every expert on one device,
token by token, with torch's autograd; testing.single_device_run); a traceback fails only that
exercise's graders (and names "NotImplementedError: exercise 5.x" when it came from an unfilled
stub).

  5.3 (sort_chunks_by_expert): the AllToAllDispatcher, with the graded re-sort inside, over an
      expert-parallel group of 2 (the pairs [0, 1] and [2, 3]) and of 4 (the world), each with
      the experts one at a time and grouped: the outputs, the gradients of the tokens, of the
      routing weights and of the local experts' weights.
  5.4 (reduction_groups): a GPT-MoE trained with expert parallelism 2 x expert-data parallelism 2
      on the 4 ranks (data-parallel 4), through DistributedDataParallel, which asks the graded
      function where to reduce each gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minimegatron.config import ModelConfig, TrainConfig
from minimegatron.model.mlp import MLP
from minimegatron.moe.dispatcher import AllToAllDispatcher
from minimegatron.testing import global_batches, train_layout
from booktools.exercises.world import run_checks

# ---------------------------------------------------------------------- 5.3: the dispatcher
# E experts (E / ep = 4 local experts on ep 2, 2 on ep 4: the re-sort is never trivial), hidden
# H, expert width F, K experts per token; member m of a group holds T0 + 2 m tokens (uneven).
E, H, F, K, T0 = 8, 6, 5, 2, 5
UNUSED_EXPERT = 5          # no token of any rank chooses it: an expert with no rows at all
EXPERT_CONFIG = ModelConfig.llama(hidden_size=H, num_layers=1, num_attention_heads=2, num_query_groups=1,
                                  ffn_hidden_size=F, vocab_size=16, max_position_embeddings=16,
                                  params_dtype="float64")


def expert(e: int) -> MLP:
    """Expert e (a SwiGLU MLP H -> 2F -> F -> H, float64), its weights a function of e only:
    every rank and the grader build the same expert e."""
    mlp = MLP(EXPERT_CONFIG, F).to(torch.float64)
    g = torch.Generator().manual_seed(1000 + e)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) / p.shape[-1] ** 0.5)
    return mlp


def dispatch_inputs(ep: int, member: int) -> dict[str, torch.Tensor]:
    """Member `member` of an expert-parallel group of `ep`: tokens [T, H], probs [T, E] (K
    positive weights per token, zero elsewhere), routing_map [T, E] (K True per token, never
    UNUSED_EXPERT; member 0 never routes to expert 0, so some chunks are empty), dout [T, H].
    Every rank and the grader build them alike."""
    g = torch.Generator().manual_seed(100 * ep + member)
    T = T0 + 2 * member
    allowed = [e for e in range(E) if e != UNUSED_EXPERT and not (member == 0 and e == 0)]
    routing_map = torch.zeros(T, E, dtype=torch.bool)
    for t in range(T):
        pick = torch.randperm(len(allowed), generator=g)[:K]
        routing_map[t, [allowed[i] for i in pick.tolist()]] = True
    probs = torch.rand(T, E, generator=g, dtype=torch.float64).add(0.1) * routing_map
    return {"tokens": torch.randn(T, H, generator=g, dtype=torch.float64), "probs": probs,
            "routing_map": routing_map, "dout": torch.randn(T, H, generator=g, dtype=torch.float64)}


def _groups():
    """(ep, group, this rank's index in it, a one-rank group for etp) for this rank's pair and for
    the world. Every rank creates every group in the same order (a rule of new_group)."""
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())]
    return [(2, pairs[rank // 2], rank % 2, alone[rank]), (4, dist.group.WORLD, rank, alone[rank])]


def dispatcher_results(groups) -> list[dict]:
    """The AllToAllDispatcher over each group, experts one at a time and grouped: this rank's
    output y, the gradients of its tokens and probs for dout, and its local experts' weight
    gradients {expert: {parameter name: gradient}}."""
    results = []
    for ep, group, member, etp_group in groups:
        for grouped in (False, True):
            inputs = dispatch_inputs(ep, member)
            local = E // ep
            experts = {e: expert(e) for e in range(member * local, (member + 1) * local)}
            tokens = inputs["tokens"].clone().requires_grad_()
            probs = inputs["probs"].clone().requires_grad_()
            y = AllToAllDispatcher(E, group, etp_group)(tokens, probs, inputs["routing_map"], experts, grouped)
            y.backward(inputs["dout"])
            results.append({"ep": ep, "member": member, "grouped": grouped, "y": y.detach(), "dtokens": tokens.grad,
                            "dprobs": probs.grad,
                            "expert_grads": {e: {n: p.grad for n, p in m.named_parameters()}
                                             for e, m in experts.items()}})
    return results


# ---------------------------------------------------------------------- 5.4: EP x expert-DP training
def moe_model() -> ModelConfig:
    """A tiny float64 LLaMA-style GPT-MoE: 2 layers, 4 experts, top-2, both auxiliary losses."""
    return ModelConfig.llama(hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                             ffn_hidden_size=64, vocab_size=64, max_position_embeddings=64, params_dtype="float64",
                             num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_aux_loss_coeff=0.01,
                             moe_z_loss_coeff=0.001)


def ep_train_config() -> TrainConfig:
    """Expert parallelism 2 on 4 data-parallel ranks (expert-data parallelism 2), 2 steps of 2
    micro-batches of 2 sequences of 16 tokens, AdamW with clipping active."""
    return TrainConfig(expert_model_parallel_size=2, seq_length=16, micro_batch_size=2, grad_accum_steps=2,
                       train_iters=2, lr_warmup_iters=0, clip_grad=0.05, progress=False, eval_interval=0)


DP = 4     # data-parallel ranks (the whole world)


def ep_training() -> dict:
    """train_layout of moe_model() under ep_train_config() on this rank: losses, first-step
    gradients and final parameters (full, single-device names), and this rank's groups."""
    m, t = moe_model(), ep_train_config()
    result = train_layout(m, t, DP, global_batches(m, t, dp=DP), tags=("grads", "expert-grads"))
    out, layout = result[0], result[2]
    out.pop("microbatches", None)
    out["ep_ranks"] = dist.get_process_group_ranks(layout.ep_group)
    out["expert_dp_ranks"] = dist.get_process_group_ranks(layout.expert_dp_group)
    return out


# ---------------------------------------------------------------------- the world
def grade_world(plan) -> dict[str, dict]:
    """On each of 4 ranks: the checks of the exercises of `plan` (booktools.exercises.world.Plan),
    each with its function plugged in. Returns run_checks' {id: {"error": ..., "data": ...}}."""
    groups = _groups()
    checks = {"5.4": ep_training,
              "5.3": lambda: dispatcher_results(groups)}
    return run_checks(checks, plan)
