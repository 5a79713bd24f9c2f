"""What one rank holds and what one training step must hand to the collectives, per dimension of
the 5D grid: the formulas the training entry's report (run_report.py, `make demo`) sets beside
the parameters a rank really holds and comm's ledger of a real step, and the one source of the
ledgers chapters 01-05's demos expect (per micro-batch, layer or phase: tensor_parallel_messages,
context_parallel_messages, dispatcher_messages, pipeline_messages, data_parallel_phases).

Legend (model/gpt.py's, with the grid's): b micro-batch size, s sequence length, h hidden size,
a query heads, g key/value groups, d head size, V vocabulary (Vp padded to a multiple of
make_vocab_size_divisible_by x tp), E experts, k top-k, M micro-batches per step, e bytes per
element; tp, cp, pp, ep, etp the grid's sizes. A rank of context-parallel size cp holds
T = b s / cp tokens of each micro-batch; under sequence parallelism its norms and residuals
T / tp of them, and a mixture routes those T / tp tokens (Megatron-Core routes each tp rank's own).

Bytes are comm's convention (comm/ledger.py): what a rank hands to the call, the shard of an
all-gather, the whole input of a reduce-scatter or an all-to-all, the tensor of a send or recv.

Per micro-batch, on a rank whose stage holds n layers, n_dense of them with a dense MLP (the
others MoE), the first stage the embedding and the last the output layer and the loss:

  tp, no SP    all_reduce "fwd" of T h e after each row-parallel product (attention's
               projection, the dense MLP's fc2) and the vocabulary-parallel embedding; "bwd",
               before each column-parallel one (qkv, fc1, the output layer); 3 all_reduce "fwd"
               of T e in the vocabulary-parallel cross-entropy (max, target logit, sum of exp)
  tp, SP       the same places: all_gather "fwd" of T h e / tp before each column-parallel product,
               reduce_scatter "fwd" of T h e after each row-parallel one (the embedding's too);
               backward: the input all-gathered again ("regather"), the input gradient
               reduce-scattered ("bwd"), and the reduce-scatters' backward all-gathers ("bwd");
               once per step, all_reduce "sp-grads" of the parameters SP replicates (the norms,
               the row-parallel biases, the routers); with learned positions the embedding's sum
               is all-reduced, then cut
  cp   p2p     cp - 1 ring steps per layer: send and recv of this rank's K and V, 2 b (s/cp)
               (g/tp) d e ("fwd"); backward, K, V and their gradients, twice that ("bwd")
       all_gather  all_gather of K and of V, b (s/cp) (g/tp) d e each, forward and "regather";
               reduce_scatter "bwd" of their gradients, cp times that
       a2a     all_to_all of q and out (b (s/cp) (a/tp) d e) and of k and v (g/tp in place of
               a/tp), forward and "bwd"
       a2a+p2p the a2a's messages, then p2p's ring over P ranks (A x P = cp, cp.hierarchical_sizes)
  ep   alltoall    per MoE layer, all_to_all "moe-counts" of E int64, "moe-dispatch" and
               "moe-combine-bwd" of the T k routed rows, T k h e (no capacity: every token
               reaches k experts); the combine and the dispatch's backward move the rows this
               rank's experts received, which depend on the routing (routing_dependent)
       allgather   chapter 05's seven messages (moe/dispatcher.py)
       both        with an auxiliary loss and tp x cp > 1, all_reduce "moe-aux" of the E routed
               counts (b E per sequence for seq_aux_loss) per MoE layer and micro-batch; with
               the expert bias, once per step all_reduce "moe-bias" of every MoE layer's E float32
               counts over the stage's ranks
  etp          all_gather "moe-counts" of E int64 (alltoall dispatcher)
  pp           per micro-batch and model chunk, the output [b, s/cp (/tp), h] sent forward and
               its gradient received back, unless the chunk is the last virtual stage; the
               input received and its gradient sent, unless it is the first
  embedding    tied embeddings over pp > 1 stages: all_reduce "embedding-grads" of Vp h / tp
               per step on the first and the last stage
  dp           each dense gradient once per step (bytes; the calls depend on the buckets):
               data_parallel_phases, from the parameters' shapes
  expert-dp    each expert gradient once per step, over the expert-data-parallel group
  recompute    (chapter 07) what a recomputed forward runs again, its tag after "recompute ": under
               tp each recomputed linear pair's forward messages (full: a layer's attention and
               MLP; selective "mlp": the MLP's), under cp each recomputed attention core's forward
               ring or gathers (full, or selective "core_attn"), and an MoE layer run again (full,
               or "moe") its counts, dispatch and auxiliary-loss messages (alltoall; allgather: not
               computed here); FP8 takes no amax again
"""

from __future__ import annotations

import math
from collections import Counter

from torch import nn

from ..config import ModelConfig, TrainConfig
from ..cp.attention import hierarchical_sizes
from ..dp.ddp import assign_buckets, megatron_default_bucket_size
from ..dp.fsdp import gpt_unit_plan
from ..pp import stage_layers
from ..tp.layers import pad_vocab_size
from .params import count_parameters

__all__ = ["rank_parameters", "step_communication", "ROUTING_DEPENDENT", "gradient_element_size", "fp8_amax_reductions",
           "tensor_parallel_messages", "context_parallel_messages", "context_parallel_step_messages",
           "dispatcher_step_messages", "pipeline_messages", "grad_norm_messages", "zero_bucket_numels",
           "zero3_unit_numels", "data_parallel_phases"]

# the dispatcher's messages whose sizes depend on the routing: checked by their sums instead
ROUTING_DEPENDENT = ("moe-combine", "moe-dispatch-bwd", "moe-etp", "moe-etp-bwd", "fp8-amax-experts")


def _stage(model_cfg: ModelConfig, cfg: TrainConfig, pp_rank: int) -> tuple[list[int], bool, bool]:
    """(the global layers a rank of stage pp_rank runs, over its model chunks; does it hold the
    embedding; does it hold the output layer)."""
    pp, v = cfg.pipeline_model_parallel_size, cfg.num_virtual_stages_per_pipeline_rank
    layers = [i for chunk in range(v) for i in stage_layers(model_cfg.num_layers, pp, pp_rank, v, chunk)]
    return layers, pp_rank == 0, pp_rank == pp - 1


def rank_parameters(model_cfg: ModelConfig, cfg: TrainConfig, pp_rank: int) -> dict[str, int]:
    """{"dense", "experts"}: the parameter elements one rank of stage pp_rank holds, from
    count_parameters' components. Per layer: attention's qkv and projection weights (and the
    qkv bias) / tp, the projection bias and the input norm whole; a dense MLP's fc1, fc2 weights
    and fc1 bias / tp, fc2's bias and the norm whole; an MoE layer's norm and router (E h) whole,
    a shared expert / tp (its fc2 bias whole), and E / ep routed experts, each / etp (fc2 bias
    whole). The first stage: the embedding, Vp h / tp (+ learned positions P h); the last: the
    final norm and an output layer of Vp h / tp when untied, or, tied over pp > 1, the copy of
    the embedding the last stage keeps."""
    tp, ep, etp = cfg.tensor_model_parallel_size, cfg.expert_model_parallel_size, cfg.etp
    c = count_parameters(model_cfg)
    layer, h = c["per_layer"], model_cfg.hidden_size
    norm = layer["norms"] // 2
    layers, first, last = _stage(model_cfg, cfg, pp_rank)
    attention = (layer["qkv_weight"] + layer["qkv_bias"] + layer["proj_weight"]) // tp + layer["proj_bias"] + norm
    mlp = (layer["fc1_weight"] + layer["fc1_bias"] + layer["fc2_weight"]) // tp + layer["fc2_bias"] + norm
    dense = experts = 0
    for i in layers:
        dense += attention
        if model_cfg.is_moe_layer(i):
            moe = c["moe"]
            bias = h if model_cfg.add_bias_linear else 0
            shared = (moe["shared"] - bias) // tp + bias if moe["shared"] else 0
            dense += norm + moe["router"] + shared
            experts += model_cfg.num_experts // ep * ((moe["expert"] - bias) // etp + bias)
        else:
            dense += mlp
    vocab = pad_vocab_size(model_cfg.vocab_size, tp, model_cfg.make_vocab_size_divisible_by) * h // tp
    if first:
        dense += vocab + c["position_embedding"]
    if last:
        own_output = model_cfg.untie_embeddings_and_output_weights or cfg.pipeline_model_parallel_size > 1
        dense += c["final_norm"] + (vocab if own_output else 0)            # untied, or the tied copy
    return {"dense": dense, "experts": experts}


def gradient_element_size(model_cfg: ModelConfig, cfg: TrainConfig) -> int:
    """Bytes of one gradient element as the reductions move it: cfg.main_grads_dtype's (float32
    beside bf16 parameters: the main_grad buffer) or the parameters' own."""
    return (cfg.main_grads_dtype or model_cfg.dtype).itemsize


def fp8_amax_reductions(model_cfg: ModelConfig, cfg: TrainConfig, pp_rank: int) -> Counter:
    """The FP8 amax all-reduces of one step on a rank of stage pp_rank (fp8/linear.py): with one
    scale per tensor (tensorwise, delayed) and tp x cp > 1, each FP8 layer of the stage's dense
    layers casts its input, its weight and its output gradient once per micro-batch with an
    amax (4 bytes) agreed over tp x cp: 3 x (4 per dense layer, 2 per MoE layer's attention, 2
    per shared expert) x M. The routed experts' casts (tag "fp8-amax-experts", over etp) depend
    on which experts got tokens: ROUTING_DEPENDENT. Blocked recipes reduce nothing."""
    if (cfg.fp8_format is None or cfg.fp8_recipe not in ("tensorwise", "delayed")
            or cfg.tensor_model_parallel_size * cfg.context_parallel_size == 1):
        return Counter()
    layers = _stage(model_cfg, cfg, pp_rank)[0]
    shared = 2 if model_cfg.moe_shared_expert_intermediate_size else 0      # a shared expert's two linears
    dense = sum(4 if not model_cfg.is_moe_layer(i) else 2 + shared for i in layers)
    return Counter({("all_reduce", "fp8-amax", 4): 3 * dense * cfg.grad_accum_steps})


def recomputed_parts(model_cfg: ModelConfig, cfg: TrainConfig, pp_rank: int) -> dict[str, int]:
    """What activation recompute (recompute.py) runs again per micro-batch on a rank of stage
    pp_rank: {"attention": transformer layers whose whole attention reruns (qkv, core, proj),
    "core_attn": attention cores only, "mlp": dense MLPs (a shared expert counts as one),
    "moe": MoE layers}. Full recompute reruns its units' layers: every layer of a chunk
    (uniform), or the first recompute_num_layers of each chunk (block)."""
    m, out = model_cfg, {"attention": 0, "core_attn": 0, "mlp": 0, "moe": 0}
    pp, v, granularity = cfg.pipeline_model_parallel_size, cfg.num_virtual_stages_per_pipeline_rank, cfg.recompute_granularity
    chunks = [stage_layers(m.num_layers, pp, pp_rank, v, c) for c in range(v)]
    if granularity == "full" and cfg.recompute_method != "uniform":
        chunks = [chunk[:cfg.recompute_num_layers] for chunk in chunks]        # "block"
    n = sum(len(chunk) for chunk in chunks)
    moe = sum(m.is_moe_layer(i) for chunk in chunks for i in chunk)
    if granularity == "full":
        out.update(attention=n, moe=moe, mlp=n - moe + (moe if m.moe_shared_expert_intermediate_size else 0))
    elif granularity == "selective":
        mods = cfg.recompute_modules
        out.update(core_attn=n * ("core_attn" in mods), mlp=(n - moe) * ("mlp" in mods), moe=moe * ("moe" in mods))
    return out


def _tp_layers(model_cfg: ModelConfig, cfg: TrainConfig, pp_rank: int) -> tuple[int, int, bool, bool]:
    """(layers of the stage, its linear pairs: attention's and each dense MLP's (a shared expert
    counts as one), first stage, last stage)."""
    layers, first, last = _stage(model_cfg, cfg, pp_rank)
    moe = sum(model_cfg.is_moe_layer(i) for i in layers)
    return len(layers), len(layers) - moe + (moe if model_cfg.moe_shared_expert_intermediate_size else 0), first, last


def tensor_parallel_messages(model_cfg: ModelConfig, cfg: TrainConfig, pp_rank: int) -> Counter:
    """Counter{(op, tag, bytes): calls}: the tensor-parallel records of ONE micro-batch on a rank
    of stage pp_rank (tp > 1; empty otherwise): the "tp" lines of the module docstring (the
    loss's three, the linears', the embedding's, recompute's), without the once-per-step
    "sp-grads" (step_communication adds it)."""
    m, tp, sp = model_cfg, cfg.tensor_model_parallel_size, cfg.sequence_parallel
    if tp == 1:
        return Counter()
    n, n_mlp, first, last = _tp_layers(m, cfg, pp_rank)
    e, h, T = m.dtype.itemsize, m.hidden_size, cfg.micro_batch_size * cfg.seq_length // cfg.context_parallel_size
    again = recomputed_parts(m, cfg, pp_rank)
    one_scale_fp8 = cfg.fp8_format is not None and cfg.fp8_recipe in ("tensorwise", "delayed")
    full, shard = T * h * e, T * h * e // tp
    c = 4 if e == 2 else e                                      # the loss computes in float32 for 16-bit models
    per_mb = Counter({("all_reduce", "fwd", T * c): 3 * last})  # vocabulary-parallel cross-entropy
    if sp:
        # the embedding's sum is reduce-scattered, or, with learned positions (added to the
        # whole sequence first), all-reduced and then cut without communication
        positions = m.position_embedding_type == "learned_absolute"
        # FP8 with one scale per tensor gathers the transformer layers' inputs as FP8 bytes
        # (fp8/linear.py's gather_input): 1 byte an element; the output layer's stays e
        fp8_gathers = (n + n_mlp) if one_scale_fp8 else 0
        per_mb[("all_gather", "fwd", T * h // tp)] += fp8_gathers
        per_mb.update({("all_gather", "fwd", shard): n + n_mlp + last - fp8_gathers,
                       ("reduce_scatter", "fwd", full): n + n_mlp + (first and not positions),
                       ("all_reduce", "fwd", full): first and positions,
                       ("all_gather", "regather", shard): n + n_mlp + last,
                       ("reduce_scatter", "bwd", full): n + n_mlp + last,
                       ("all_gather", "bwd", shard): n + n_mlp + first})
        linears_again = again["attention"] + again["mlp"]              # each gathers its input, scatters its output
        per_mb.update({("all_gather", "recompute fwd", T * h // tp if one_scale_fp8 else shard): linears_again,
                       ("reduce_scatter", "recompute fwd", full): linears_again})
    else:
        per_mb.update({("all_reduce", "fwd", full): n + n_mlp + first,
                       ("all_reduce", "bwd", full): n + n_mlp + last,
                       ("all_reduce", "recompute fwd", full): again["attention"] + again["mlp"]})
    return Counter({k: c for k, c in per_mb.items() if c})


def context_parallel_messages(model_cfg: ModelConfig, cfg: TrainConfig) -> Counter:
    """Counter{(op, tag, bytes): calls}: the context-parallel records of ONE attention layer
    and micro-batch (cp > 1; empty otherwise), kv = b (s/cp) (g/tp) d e one of K, V and q =
    b (s/cp) (a/tp) d e: the "cp" lines of the module docstring; "a2a+p2p" (A x P ranks,
    cp.hierarchical_sizes) runs the a2a's messages, then p2p's ring over P."""
    m, tp, cp = model_cfg, cfg.tensor_model_parallel_size, cfg.context_parallel_size
    if cp == 1:
        return Counter()
    e, local = m.dtype.itemsize, cfg.micro_batch_size * (cfg.seq_length // cp)
    kv = local * (m.query_groups // tp) * m.kv_channels * e
    q = local * (m.num_attention_heads // tp) * m.kv_channels * e

    def ring(n: int) -> Counter:
        return Counter({("send", "fwd", 2 * kv): n - 1, ("recv", "fwd", 2 * kv): n - 1,
                        ("send", "bwd", 4 * kv): n - 1, ("recv", "bwd", 4 * kv): n - 1})
    a2a = Counter(("all_to_all", tag, size) for tag in ("fwd", "bwd") for size in (q, kv, kv, q))   # q == kv: 4
    if cfg.cp_comm_type == "p2p":
        return ring(cp)
    if cfg.cp_comm_type == "all_gather":
        return Counter({("all_gather", "fwd", kv): 2, ("all_gather", "regather", kv): 2,
                        ("reduce_scatter", "bwd", cp * kv): 2})
    if cfg.cp_comm_type == "a2a":
        return a2a
    return +(a2a + ring(hierarchical_sizes(cp, cfg.cp_comm_type, cfg.hierarchical_context_parallel_sizes)[1]))


def context_parallel_step_messages(model_cfg: ModelConfig, cfg: TrainConfig, pp_rank: int) -> Counter:
    """context_parallel_messages times the layers of stage pp_rank and the M micro-batches, and
    the forward's messages again for each attention core recompute runs again."""
    per_layer, M = context_parallel_messages(model_cfg, cfg), cfg.grad_accum_steps
    again = recomputed_parts(model_cfg, cfg, pp_rank)
    cores_again = again["attention"] + again["core_attn"]
    out = Counter({k: c * len(_stage(model_cfg, cfg, pp_rank)[0]) * M for k, c in per_layer.items()})
    out.update({(op, "recompute fwd", nbytes): c * cores_again * M
                for (op, tag, nbytes), c in per_layer.items() if tag == "fwd" and cores_again})
    return out


def dispatcher_messages(model_cfg: ModelConfig, cfg: TrainConfig) -> dict[str, Counter]:
    """{"ep", "etp"}: Counter{(op, tag, bytes): calls} of the token dispatcher's messages of ONE
    MoE layer and micro-batch that do not depend on the routing (the "ep" and "etp" lines of the
    module docstring: alltoall's counts, dispatch and combine-bwd; allgather's seven). With a
    capacity factor the sizes without dropping: the real ones then depend on the routing."""
    m, tp, ep, etp = model_cfg, cfg.tensor_model_parallel_size, cfg.expert_model_parallel_size, cfg.etp
    e, h, E, k = m.dtype.itemsize, m.hidden_size, m.num_experts, m.moe_router_topk
    Tm = cfg.micro_batch_size * cfg.seq_length // cfg.context_parallel_size // (tp if cfg.sequence_parallel else 1)
    out = {"ep": Counter(), "etp": Counter()}
    if cfg.moe_token_dispatcher_type == "alltoall":
        if ep > 1:
            out["ep"] = Counter({("all_to_all", "moe-counts", 8 * E): 1, ("all_to_all", "moe-dispatch", Tm * k * h * e): 1,
                                 ("all_to_all", "moe-combine-bwd", Tm * k * h * e): 1})
        if etp > 1:
            out["etp"] = Counter({("all_gather", "moe-counts", 8 * E): 1})
    elif ep * etp > 1:
        g = ep * etp
        out["ep"] = Counter([("all_gather", "moe-allgather", Tm * h * e), ("all_gather", "moe-allgather", Tm * E * e),
                             ("all_gather", "moe-allgather", Tm * E), ("reduce_scatter", "moe-allgather", g * Tm * h * e),
                             ("reduce_scatter", "moe-allgather-bwd", g * Tm * h * e),
                             ("reduce_scatter", "moe-allgather-bwd", g * Tm * E * e),
                             ("all_gather", "moe-allgather-bwd", Tm * h * e)])
    return out


def dispatcher_step_messages(model_cfg: ModelConfig, cfg: TrainConfig, pp_rank: int) -> Counter:
    """dispatcher_messages of both groups, times the MoE layers of stage pp_rank and the M
    micro-batches: the routing-independent dispatcher records of one step."""
    moe_layers = sum(model_cfg.is_moe_layer(i) for i in _stage(model_cfg, cfg, pp_rank)[0])
    both = sum(dispatcher_messages(model_cfg, cfg).values(), Counter())
    return Counter({key: c * moe_layers * cfg.grad_accum_steps for key, c in both.items()})


def pipeline_messages(model_cfg: ModelConfig, cfg: TrainConfig, pp_rank: int) -> Counter:
    """Counter{(op, tag, bytes): calls}: the p2p records of one step on stage pp_rank (the "pp"
    line of the module docstring): per micro-batch and model chunk, [b, s/cp (/tp), h] sent
    forward ("pp-fwd") and its gradient received ("pp-bwd") unless the chunk is the last virtual
    stage, received and its gradient sent unless it is the first."""
    tp, sp, M = cfg.tensor_model_parallel_size, cfg.sequence_parallel, cfg.grad_accum_steps
    T = cfg.micro_batch_size * cfg.seq_length // cfg.context_parallel_size
    message = T // (tp if sp else 1) * model_cfg.hidden_size * model_cfg.dtype.itemsize
    v = cfg.num_virtual_stages_per_pipeline_rank
    sends_forward = v - (pp_rank == cfg.pipeline_model_parallel_size - 1)   # chunks not the last virtual stage
    receives_forward = v - (pp_rank == 0)                                   # chunks not the first
    return +Counter({("send", "pp-fwd", message): M * sends_forward, ("recv", "pp-bwd", message): M * sends_forward,
                     ("recv", "pp-fwd", message): M * receives_forward,
                     ("send", "pp-bwd", message): M * receives_forward})


def step_communication(model_cfg: ModelConfig, cfg: TrainConfig, world: int, pp_rank: int) -> dict[str, Counter]:
    """{dimension: Counter{(op, tag, bytes): calls}}: the records one optimizer step must make
    on a rank of stage pp_rank of a world of `world` ranks, for every dimension above 1, but the dispatcher's
    ROUTING_DEPENDENT messages, the gradient reductions (their bytes: rank_parameters) and the
    loss and norm all-reduces. None for cp under "a2a+p2p" and ep with a capacity factor (not
    computed here). See the module docstring for each line."""
    m = model_cfg
    tp, cp, pp = cfg.tensor_model_parallel_size, cfg.context_parallel_size, cfg.pipeline_model_parallel_size
    ep, etp, M = cfg.expert_model_parallel_size, cfg.etp, cfg.grad_accum_steps
    e, h, b, sp = m.dtype.itemsize, m.hidden_size, cfg.micro_batch_size, cfg.sequence_parallel
    n, n_mlp, first, last = _tp_layers(m, cfg, pp_rank)
    moe_layers = [i for i in _stage(m, cfg, pp_rank)[0] if m.is_moe_layer(i)]
    out: dict[str, Counter] = {}
    # activation recompute (chapter 07) runs some forwards again in the backward: their
    # collectives again, their tags after "recompute " (an FP8 recompute casts with the first forward's
    # scales: no amax again)
    again = recomputed_parts(m, cfg, pp_rank)

    if tp > 1:
        out["tp"] = Counter({k: c * M for k, c in tensor_parallel_messages(m, cfg, pp_rank).items()})
        if sp:
            counts = count_parameters(m)
            layer = counts["per_layer"]
            routers = len(moe_layers) * counts["moe"]["router"] if moe_layers else 0
            replicated = ((layer["norms"] + layer["proj_bias"]) * n + layer["fc2_bias"] * n_mlp + routers
                          + (counts["final_norm"] if last else 0))
            out["tp"][("all_reduce", "sp-grads", replicated * gradient_element_size(m, cfg))] += 1

    if cp > 1:                      # a2a+p2p's records go to two sub-groups, not the cp group run_report sorts by
        out["cp"] = None if cfg.cp_comm_type == "a2a+p2p" else context_parallel_step_messages(m, cfg, pp_rank)

    if moe_layers and m.moe_expert_capacity_factor is None:
        E = m.num_experts
        out.update({dim: c for dim, c in dispatcher_messages(m, cfg).items() if c})
        if (m.moe_aux_loss_coeff or m.moe_z_loss_coeff) and tp * cp > 1:
            # the auxiliary losses' token set is a micro-batch's tokens over tp x cp: its routed counts summed there
            per_sequence = b if m.moe_router_load_balancing_type == "seq_aux_loss" else 1
            out.setdefault("ep", Counter())[("all_reduce", "moe-aux", per_sequence * E * e)] += 1
        for dim in ("ep", "etp"):
            if dim in out:
                # an MoE layer run again counts and dispatches again (the alltoall's forward messages)
                repeated = Counter({(op, f"recompute {tag}", nbytes): c for (op, tag, nbytes), c in out[dim].items()
                                    if tag in ("moe-counts", "moe-dispatch", "moe-aux")})
                out[dim] = Counter({key: c * len(moe_layers) * M for key, c in out[dim].items()})
                out[dim].update({key: c * again["moe"] * M for key, c in repeated.items()})
        if again["moe"] and cfg.moe_token_dispatcher_type == "allgather" and ep * etp > 1:
            out["ep"] = None                                        # its forward messages again: not computed here
        if m.moe_router_enable_expert_bias and world // pp > 1 and out.get("ep", Counter()) is not None:
            # the expert bias: the step's routed counts of every MoE layer, summed over the stage's ranks
            out.setdefault("ep", Counter())[("all_reduce", "moe-bias", len(moe_layers) * E * 4)] += 1   # float32
    elif moe_layers and ep * etp > 1:
        out["ep"] = None

    if pp > 1:
        out["pp"] = pipeline_messages(m, cfg, pp_rank)
        if not m.untie_embeddings_and_output_weights and (first or last):
            vocab = pad_vocab_size(m.vocab_size, tp, m.make_vocab_size_divisible_by) * h // tp
            out["embedding"] = Counter({("all_reduce", "embedding-grads", vocab * gradient_element_size(m, cfg)): 1})
    if fp8 := fp8_amax_reductions(m, cfg, pp_rank):
        out["fp8"] = fp8
    return out


def grad_norm_messages(cfg: TrainConfig, e: int) -> Counter:
    """The optimizer step's all_reduce "grad-norm" of the squared norm (e bytes) over the dense
    parameters' model-parallel groups above 1, tp and pp (optim.NormGroup,
    parallelize.build_optimizer); the data-parallel one under ZeRO: data_parallel_phases."""
    calls = (cfg.tensor_model_parallel_size > 1) + (cfg.pipeline_model_parallel_size > 1)
    return Counter({("all_reduce", "grad-norm", e): calls}) if calls else Counter()


def zero_bucket_numels(model: nn.Module, bucket_size: int | None) -> list[int]:
    """ZeRO-1/2's buckets (dp/zero.py): the parameters in reverse order, split by weight decay
    (matrices first, then vectors), each group cut by the bucket rule (`assign_buckets`)."""
    named = list(model.named_parameters())[::-1]
    sizes = []
    for decay in (True, False):
        numels = [p.numel() for _, p in named if (p.dim() >= 2) == decay]
        sizes += [sum(numels[i] for i in b) for b in assign_buckets(numels, bucket_size)]
    return sizes


def zero3_unit_numels(model: nn.Module) -> dict[str, int]:
    """ZeRO-3's units (dp/fsdp.py's gpt_unit_plan), in forward order: the embedding, each layer,
    the head (final norm and an untied output layer)."""
    named = list(model.named_parameters())
    return {u.name: sum(p.numel() for n, p in named if n.startswith(u.prefixes)) for u in gpt_unit_plan(model)}


def data_parallel_phases(model: nn.Module, cfg: TrainConfig, dp: int, e: int) -> list[list[tuple[str, int, str]]]:
    """The data-parallel records of each phase of a step (micro-batches 0..M-1, the optimizer
    step), (op, bytes, tag), on a rank holding `model` (a GPTModel) in a group of dp ranks, e
    bytes per element:

      naive   last micro-batch: one all_reduce per parameter, numel(p) e each ("grads")
      ddp     last micro-batch: one all_reduce per bucket (assign_buckets over the reversed
              parameters, ddp_bucket_size elements; Megatron's default: one bucket)
      zero1/2 last micro-batch: one reduce_scatter per bucket, dp S_b e ("grads"),
              S_b = ceil(n_b / dp); optimizer step: all_reduce of the squared norm, e
              ("grad-norm"), then one all_gather per bucket, S_b e ("params")
      zero3   every micro-batch: an all_gather S_u e per use of a unit before its forward
              ("fwd") and again for its backward ("bwd"; not the embedding lookup's use,
              whose backward reads no weight); last micro-batch: a reduce_scatter dp S_u e per
              use ("grads"); a tied head is one more use of the embedding unit; optimizer
              step: the norm's all_reduce ("grad-norm")
    Nothing inside no_sync for stages 0-2. A group of one rank communicates nothing."""
    M, stage = cfg.grad_accum_steps, cfg.zero_stage
    phases: list[list[tuple[str, int, str]]] = [[] for _ in range(M + 1)]
    if dp == 1:
        return phases
    if stage == 0 and cfg.ddp_impl == "naive":
        phases[M - 1] = [("all_reduce", p.numel() * e, "grads") for p in model.parameters()]
    elif stage == 0:
        numels = [p.numel() for p in model.parameters()][::-1]
        size = cfg.ddp_bucket_size or megatron_default_bucket_size(dp)
        phases[M - 1] = [("all_reduce", sum(numels[i] for i in b) * e, "grads") for b in assign_buckets(numels, size)]
    elif stage in (1, 2):
        shards = [math.ceil(n / dp) for n in zero_bucket_numels(model, cfg.ddp_bucket_size)]
        phases[M - 1] = [("reduce_scatter", dp * s * e, "grads") for s in shards]
        phases[M] = [("all_reduce", e, "grad-norm")] + [("all_gather", s * e, "params") for s in shards]
    if stage < 3:
        return phases
    shard = {u: math.ceil(n / dp) for u, n in zero3_unit_numels(model).items()}
    uses = list(shard) + [b for u in gpt_unit_plan(model) for b in u.borrows]      # a tied head's embedding
    for m in range(M):
        phases[m] = [("all_gather", shard[u] * e, "fwd") for u in uses]
        phases[m] += [("all_gather", shard[u] * e, "bwd") for u in uses[1:]]
        if m == M - 1:
            phases[m] += [("reduce_scatter", dp * shard[u] * e, "grads") for u in uses]
    phases[M] = [("all_reduce", e, "grad-norm")]
    return phases
