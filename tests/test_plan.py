"""The parallelism planner (minimegatron.plan, chapter 08): Megatron's formulas against numbers
worked by hand and against the book's analysis; the search's verdicts against validate_layout;
its memory against analysis; the command line's exit codes. Fast: no process is spawned."""

from __future__ import annotations

import dataclasses

import pytest

from minimegatron.analysis import (activation_memory, count_parameters, korthikanti_activation_memory,
                                   rank_parameters, tensor_parallel_parameters, training_flops, training_memory)
from minimegatron.config import ConfigError, ModelConfig, TrainConfig
from minimegatron.parallel_state import rank_groups
from minimegatron.parallelize import validate_layout
from minimegatron.plan import (CLUSTERS, Cluster, Layout, megatron_activation_bytes, megatron_flops,
                               megatron_weight_and_optimizer_bytes, planner_model, rank_memory, search,
                               step_estimate)
from minimegatron.plan.__main__ import main
from minimegatron.plan.search import USABLE_MEMORY
from minimegatron.parallel_state import check_grids
from minimegatron.plan.step_time import COMPUTE_EFFICIENCY, group_shapes, wire_bytes

H100 = CLUSTERS["h100-sxm"]


# ---------------------------------------------------------------------------------------
# Megatron's num_floating_point_operations
# ---------------------------------------------------------------------------------------
def test_megatron_flops_llama3_8b_by_hand():
    """Llama-3 8B, one sequence of 8192 tokens. Per token, every GEMM 3 times at 2 FLOPs:
      MLP        h 3f L            = 4096 x 3 x 14336 x 32              = 5,637,144,576
      attention  L (h (a d + 2 g d) + a d h) = 32 x (4096 x 6144 + 4096 x 4096) = 1,342,177,280
      logits     h Vp              = 4096 x 128256 (already a multiple of 128) = 525,336,576
      sum 7,504,658,432, x 6                                             = 45,027,950,592
      core       6 a d L s (the causal half of 2 x 2 s a d, 3 passes) = 6 x 4096 x 32 x 8192 = 6,442,450,944
    x 8192 tokens = 8192 x 51,470,401,536."""
    config, _, _ = planner_model("llama3-8b")
    flops = megatron_flops(config, batch=1, seq=8192)
    assert flops["mlp"] == 8192 * 6 * 5_637_144_576
    assert flops["attention"] == 8192 * 6 * 1_342_177_280
    assert flops["logits"] == 8192 * 6 * 525_336_576
    assert flops["core"] == 8192 * 6_442_450_944
    assert flops["total"] == 421_645_529_382_912
    assert megatron_flops(config, batch=4, seq=8192)["total"] == 4 * 421_645_529_382_912


def test_megatron_flops_mixtral_by_hand():
    """Mixtral 8x7B, one sequence of 4096 tokens: the MLP term counts k = 2 experts of f = 14336,
      MLP        h 3 f k L = 4096 x 3 x 14336 x 2 x 32  = 11,274,289,152
      attention  as Llama-3 8B's (same h, a, g, L)       =  1,342,177,280
      logits     4096 x 32000 (250 x 128, no padding)     =    131,072,000
      x 6 = 76,485,230,592; core 6 x 4096 x 32 x 4096 = 3,221,225,472 per token.
    Under tp = 8 the vocabulary pads to a multiple of 1024: 32768, 768 rows more."""
    config, _, _ = planner_model("mixtral-8x7b")
    per_token = 76_485_230_592 + 3_221_225_472
    assert megatron_flops(config, batch=1, seq=4096)["total"] == 4096 * per_token == 326_477_644_038_144
    assert (megatron_flops(config, batch=1, seq=4096, tp=8)["total"]
            == 4096 * per_token + 4096 * 6 * 4096 * 768)


@pytest.mark.parametrize("moe", [False, True])
def test_megatron_flops_differs_from_the_books_count_as_documented(moe):
    """The book's training_flops counts the matmuls our model runs: all s^2 scores (the masked
    half too), the router, the unpadded vocabulary. Megatron = book - core/2 - router + the
    padding's logits. GELU, multi-head, biases, a shared expert in every other layer."""
    config = ModelConfig.gpt2(hidden_size=64, num_layers=4, num_attention_heads=4, vocab_size=1000,
                              make_vocab_size_divisible_by=16, max_position_embeddings=128)
    if moe:
        config = dataclasses.replace(config, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=96,
                                     moe_layer_freq=2, moe_shared_expert_intermediate_size=32)
    B, s, tp = 3, 128, 2
    book = training_flops(config, B, s)
    forward = book["forward"]
    core = 3 * (forward["attention_scores"] + forward["attention_over_values"])
    router = 3 * forward.get("router", 0)
    Vp = 1024                                           # 1000 padded to a multiple of 16 x 2
    expected = book["total"] - core // 2 - router + 6 * B * s * config.hidden_size * (Vp - 1000)
    assert megatron_flops(config, B, s, tp)["total"] == expected
    assert (router > 0) == moe


# ---------------------------------------------------------------------------------------
# Megatron's theoretical memory
# ---------------------------------------------------------------------------------------
def test_megatron_weight_memory_llama3_8b_by_hand():
    """One rank holds the whole model: per layer attention 4096 x 6144 + 4096 x 4096 =
    41,943,040, MLP 3 x 4096 x 14336 = 176,160,768, two RMSNorms 8192: 218,112,000; x 32 =
    6,979,584,000; + final norm 4096 + two vocabulary matrices 2 x 525,336,576: 8,030,261,248
    parameters, 18 bytes each without the distributed optimizer."""
    config, _, _ = planner_model("llama3-8b")
    assert count_parameters(config)["total"] == 8_030_261_248
    assert megatron_weight_and_optimizer_bytes(config, TrainConfig(bf16=True), 1) == 18 * 8_030_261_248


@pytest.mark.parametrize("name, world, sizes", [
    ("llama3-8b", 64, dict(tensor_model_parallel_size=8, sequence_parallel=True)),
    ("llama3-8b", 64, dict(tensor_model_parallel_size=4, pipeline_model_parallel_size=2, sequence_parallel=True)),
    ("mixtral-8x7b", 16, dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=4,
                              expert_tensor_parallel_size=1)),
])
def test_megatron_weight_memory_agrees_with_the_books_rank_state(name, world, sizes):
    """Where both describe the same thing (no biases, cp = 1, the distributed optimizer = ZeRO-1,
    untied embeddings: the first stage holds the embedding, the last the output layer, one each)
    Megatron's 6 + 12/dp bytes per parameter on the first stage equals the book's
    rank_parameters x (2 + 4 + 12 / shards), up to the book's ceil(n / shards) per shard, but for
    one documented difference: Megatron spreads the final norm's h elements over the p stages
    (h / p on the first), the book's last stage holds it."""
    config, _, _ = planner_model(name)
    cfg = TrainConfig(bf16=True, zero_stage=1, **sizes)
    book = rank_memory(config, cfg, world, 0)
    states = book["params"] + book["grads"] + book["optimizer"]
    pp = cfg.pipeline_model_parallel_size
    dp = world // (cfg.tensor_model_parallel_size * pp)
    final_norm = config.hidden_size / pp * (6 + 12 / dp) if pp > 1 else 0
    assert megatron_weight_and_optimizer_bytes(config, cfg, world) - final_norm == pytest.approx(states, abs=24)


def test_megatron_activation_memory_by_hand():
    """Llama-3 8B, b = 1, s = 8192 (s b h = 33,554,432):
    SP + selective, tp = 2: per layer s b h (18 + 4 x 14336 / 4096) = 32 s b h = 1,073,741,824, x 32
    layers = 34,359,738,368; embedding 8 s b + s b h = 33,619,968; output and loss (p = 1)
    4 s b h (1 + 128256 / 4096) = 4,336,910,336; sum 38,730,268,672 / tp.
    Otherwise (tp = 1, no recompute): 34 s b h x 32 = 36,507,222,016 + 33,619,968 + 2 (s b Vp + s b h)
    = 2,168,455,168; x 1.05."""
    config, _, _ = planner_model("llama3-8b")
    sp = TrainConfig(seq_length=8192, micro_batch_size=1, tensor_model_parallel_size=2, sequence_parallel=True,
                     recompute_granularity="selective", bf16=True)
    assert megatron_activation_bytes(config, sp) == 38_730_268_672 / 2
    plain = TrainConfig(seq_length=8192, micro_batch_size=1, bf16=True)
    assert megatron_activation_bytes(config, plain) == pytest.approx(38_709_297_152 * 1.05)
    # the pipeline: 1F1B's first stage with m = 2 < p = 4 holds half of p micro-batches (no output layer)
    piped = dataclasses.replace(plain, pipeline_model_parallel_size=4, grad_accum_steps=2)
    layers_and_embedding = 36_507_222_016 + 4 * 33_619_968
    assert megatron_activation_bytes(config, piped) == pytest.approx(layers_and_embedding * 0.5 * 1.05)
    interleaved = dataclasses.replace(piped, num_virtual_stages_per_pipeline_rank=2, grad_accum_steps=8)
    assert megatron_activation_bytes(config, interleaved) == pytest.approx(layers_and_embedding * (1 + 3 / 8) * 1.05)


def test_megatron_activation_layer_term_is_korthikanti_without_the_scores():
    """For a GPT-2 style layer (f = 4h), Megatron's SP + selective per-layer term, 34 s b h / t, is
    the book's korthikanti_activation_memory with SP minus the 5 a s^2 b / t that selective
    recompute drops."""
    config = ModelConfig.gpt2(hidden_size=256, num_layers=2, num_attention_heads=8, vocab_size=512,
                              max_position_embeddings=1024, make_vocab_size_divisible_by=128)
    b, s, t = 2, 1024, 4
    cfg = TrainConfig(seq_length=s, micro_batch_size=b, tensor_model_parallel_size=t, sequence_parallel=True,
                      recompute_granularity="selective", pipeline_model_parallel_size=2, grad_accum_steps=2)
    embedding = 8 * s * b * 2 + s * b * 256 * 2                     # p = 2 in flight, no output layer
    layers = megatron_activation_bytes(config, cfg) - embedding / t      # per rank
    paper = korthikanti_activation_memory(config, b, s, tp=t, sequence_parallel=True)["total"]
    assert layers == pytest.approx(paper - config.num_layers * 5 * 8 * s * s * b // t)


# ---------------------------------------------------------------------------------------
# the planner's memory is the book's analysis
# ---------------------------------------------------------------------------------------
def _tiny():
    config, seq, _ = planner_model("tiny")
    return config, seq


def test_planner_memory_equals_analysis_for_the_tiny_preset():
    """tp = pp = cp = 1: the states are analysis.training_memory's (bf16 with float32 main
    gradients and copies: 2 + 4 + 12), the activations activation_memory's (one micro-batch in
    flight); with tp = 2 and SP, tensor_parallel_parameters' per-rank count and the SP activations;
    with full recompute, activation_memory's full recompute."""
    config, seq = _tiny()
    cfg = TrainConfig(seq_length=seq, micro_batch_size=4, bf16=True, zero_stage=1)
    mine = rank_memory(config, cfg, 4, 0)
    book = training_memory(config, param_dtype="bfloat16", grad_dtype="float32", master_weights=True,
                           zero_stage=1, dp=4)
    assert (mine["params"], mine["grads"], mine["optimizer"]) == (book["params"], book["grads"], book["optimizer"])
    assert mine["activations"] == activation_memory(config, 4, seq, "bfloat16", dropout_mask_itemsize=1)["total"]

    tp2 = dataclasses.replace(cfg, tensor_model_parallel_size=2, sequence_parallel=True, zero_stage=0)
    mine = rank_memory(config, tp2, 4, 0)
    elements = tensor_parallel_parameters(config, 2)["per_rank"]
    assert (mine["params"], mine["grads"], mine["optimizer"]) == (2 * elements, 4 * elements, 12 * elements)
    assert mine["activations"] == activation_memory(config, 4, seq, "bfloat16", dropout_mask_itemsize=1, tp=2,
                                                    sequence_parallel=True)["total"]

    full = dataclasses.replace(cfg, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    assert rank_memory(config, full, 4, 0)["activations"] == activation_memory(
        config, 4, seq, "bfloat16", dropout_mask_itemsize=1, recompute_granularity="full",
        recompute_method="uniform", recompute_num_layers=1)["total"]


def test_pipeline_stages_split_the_books_activations_and_hold_1f1b_in_flight():
    """pp = 2 with one micro-batch: the two stages' activations add up to the whole model's; with
    m = 4 the first stage of 1F1B holds min(pp, m) = 2 micro-batches, the last one."""
    config, seq = _tiny()
    whole = activation_memory(config, 2, seq, "bfloat16", dropout_mask_itemsize=1)
    cfg = TrainConfig(seq_length=seq, micro_batch_size=2, bf16=True, pipeline_model_parallel_size=2)
    first, last = rank_memory(config, cfg, 2, 0), rank_memory(config, cfg, 2, 1)
    assert first["activations"] + last["activations"] == whole["total"]
    outside = whole["outside_layers"]
    embedding = sum(outside[k] for k in ("tokens", "position_ids", "embedding_dropout_mask", "rope_tables"))
    assert first["activations"] == whole["per_layer"]["total"] + embedding       # tiny: one layer per stage
    four = dataclasses.replace(cfg, grad_accum_steps=4)
    assert rank_memory(config, four, 2, 0)["activations"] == 2 * first["activations"]
    assert rank_memory(config, four, 2, 1)["activations"] == last["activations"]


# ---------------------------------------------------------------------------------------
# where groups sit, and the time model
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("tp, cp, pp, ep, etp", [(2, 2, 2, 1, 2), (4, 1, 2, 2, 1), (1, 4, 1, 8, 1), (8, 2, 1, 4, 2)])
def test_the_placement_rule_matches_rank_groups(tp, cp, pp, ep, etp):
    """Cluster.intra_node(stride, size) says whether a group shares a node; rank_groups lists the
    groups: they must agree for every dimension (32 ranks, nodes of 8)."""
    world, node = 32, Cluster("test", 8, 1, 1.0, 1.0, 1.0)
    cfg = TrainConfig(tensor_model_parallel_size=tp, context_parallel_size=cp, pipeline_model_parallel_size=pp,
                      expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    groups = rank_groups(world, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp)
    shapes = group_shapes(cfg, world)
    for dim, key in (("tp", "tp"), ("cp", "cp"), ("dp", "dp-cp"), ("pp", "pp"), ("ep", "ep"), ("etp", "etp"),
                     ("expert-dp", "expert-dp")):
        inside = all(len({r // 8 for r in group}) == 1 for group in groups[key])
        assert node.intra_node(*shapes[dim]) == inside, (dim, shapes[dim], groups[key][0])


def test_check_grids_raises_as_rank_groups_does():
    for args in [dict(world_size=16, tp=2, pp=2), dict(world_size=12, tp=8), dict(world_size=16, tp=2, ep=3),
                 dict(world_size=16, tp=2, pp=2, ep=2, order="tp-pp-cp-ep-dp"), dict(world_size=16, cp=0)]:
        try:
            rank_groups(**args)
            expected = None
        except ValueError as exc:
            expected = str(exc)
        try:
            check_grids(**args)
            got = None
        except ValueError as exc:
            got = str(exc)
        assert got == expected, args


def test_wire_bytes_of_ring_collectives():
    assert wire_bytes("all_reduce", 800, 8) == 1400              # 2 (n-1)/n
    assert wire_bytes("reduce_scatter", 800, 8) == 700           # (n-1)/n of the input
    assert wire_bytes("all_gather", 100, 8) == 700               # (n-1) shards
    assert wire_bytes("send", 5, 2) == 5 and wire_bytes("recv", 5, 2) == 0
    assert wire_bytes("all_reduce", 800, 1) == 0


def test_hidden_and_exposed_data_parallel_time_by_hand():
    """Llama-3 8B, data parallel only (ZeRO-1, 8 ranks per node). In one node the gradients'
    reduce-scatter (7/8 x 4 N bytes) and the parameters' all-gather (7 shards of 2 N / 8 bytes)
    take 0.093 s at 450 GB/s, less than one micro-batch's compute: the step is compute alone,
    m x Megatron's FLOPs / (GPUs x peak x 50%). Over 2 nodes with a short batch they are exposed:
    the step is then the communication alone, at the network's 50 GB/s."""
    config, _, _ = planner_model("llama3-8b")
    N = count_parameters(config)["total"]
    cfg = TrainConfig(seq_length=4096, micro_batch_size=1, grad_accum_steps=8, bf16=True, zero_stage=1,
                      overlap_grad_reduce=True, overlap_param_gather=True)
    est = step_estimate(config, cfg, 8, H100)
    flops = megatron_flops(config, 64, 4096)["total"]
    assert est["step_time"] == pytest.approx(flops / (8 * 989e12 * COMPUTE_EFFICIENCY))
    assert est["mfu"] == pytest.approx(COMPUTE_EFFICIENCY)
    short = dataclasses.replace(cfg, seq_length=256, grad_accum_steps=1)
    n = 16
    wire = (n - 1) / n * 4 * N + (n - 1) * -(-N // n) * 2
    assert step_estimate(config, short, n, H100)["step_time"] == pytest.approx(wire / 50e9)


# ---------------------------------------------------------------------------------------
# the search
# ---------------------------------------------------------------------------------------
def test_a_known_invalid_layout_is_rejected_with_validate_layouts_reason():
    """The tiny preset has 2 key/value groups: tp = 4 cannot split them. Every such layout is
    rejected, and the reason shown is validate_layout's own message."""
    config, seq = _tiny()
    result = search(config, H100, 8, seq, 64, tp=4, pp=1, cp=1, zero=1, recompute="none", mbs=4)
    assert result.plans == [] and result.considered == 1
    (pattern, (layout, message)), = result.examples.items()
    with pytest.raises(ConfigError) as exc:
        validate_layout(config, layout.train_config(seq), 8)
    assert message == str(exc.value) and "num_query_groups=2" in message


def test_the_top_plan_of_a_small_case_fits_and_runs_in_the_book():
    config, _, _ = planner_model("llama3-8b")
    result = search(config, H100, 16, 4096, 64)
    assert result.plans and sum(result.rejected.values()) + len(result.plans) == result.considered
    best = result.plans[0]
    usable = USABLE_MEMORY * 80 * 2**30
    for stage in sorted({0, best.layout.pp - 1}):
        assert rank_memory(config, best.train_cfg, 16, stage)["total"] <= usable
    validate_layout(config, best.train_cfg, 16)                          # raises if the book cannot run it
    times = [p.estimate["step_time"] for p in result.plans]
    assert times == sorted(times)
    assert 0 < best.estimate["mfu"] < COMPUTE_EFFICIENCY
    assert best.estimate["bubble"] == pytest.approx((best.layout.pp - 1) / (best.layout.vp * best.layout.m))
    # a rejected layout names its reason: tp of 16 GPUs spans two nodes
    assert any("does not fit in one node of 8 GPUs" in message for _, message in result.examples.values())


def test_skipping_by_the_compute_bound_keeps_the_same_top_plans():
    """search(keep=k) skips the estimate of a layout whose compute and bubble alone are already
    slower than the k-th best so far: the top k must be those of the full search, and every
    skipped layout must really be slower than the k-th (its exact estimate says so)."""
    config, _, _ = planner_model("mixtral-8x7b")
    pins = dict(cp=1, mbs=1)
    everything = search(config, H100, 16, 4096, 32, **pins)
    pruned = search(config, H100, 16, 4096, 32, keep=3, **pins)
    assert pruned.unranked > 0 and everything.unranked == 0
    assert len(pruned.plans) + pruned.unranked == len(everything.plans)
    assert [p.layout for p in pruned.plans[:3]] == [p.layout for p in everything.plans[:3]]
    ranked = {p.layout for p in pruned.plans}
    third = everything.plans[2].estimate["step_time"]
    assert all(p.estimate["step_time"] >= third for p in everything.plans if p.layout not in ranked)


def test_layout_string_and_train_config():
    layout = Layout(tp=4, cp=2, pp=4, vp=2, ep=1, etp=4, dp=8, zero=1, recompute="full", mbs=1, m=16)
    cfg = layout.train_config(8192)
    assert (cfg.sequence_parallel, cfg.pipeline_schedule, cfg.recompute_method) == (True, "interleaved", "uniform")
    assert str(layout) == "tp4 cp2 pp4v2 dp8 zero1 full mbs1 m16"


def test_deepseek_v3_is_described_approximately_and_says_so():
    config, seq, note = planner_model("deepseek-v3")
    assert "APPROXIMATE" in note and "multi-latent attention" in note
    assert [config.is_moe_layer(i) for i in (0, 2, 3, 60)] == [False, False, True, True]
    counts = count_parameters(config)
    assert 660e9 < counts["total"] < 680e9 and 35e9 < counts["active"] < 40e9     # published: 671B, 37B
    assert rank_parameters(config, TrainConfig(expert_model_parallel_size=256, expert_tensor_parallel_size=1,
                                               tensor_model_parallel_size=1), 0)["experts"] == \
        58 * 3 * 7168 * 2048                                                      # one expert per MoE layer


# ---------------------------------------------------------------------------------------
# the command line
# ---------------------------------------------------------------------------------------
def test_cli_prints_a_plan_and_exits_0(capsys):
    code = main(["--model", "llama3-8b", "--cluster", "h100-sxm", "--gpus", "16", "--seq-length", "4096",
                 "--global-batch-size", "64", "--top", "3"]).exit_code
    out = capsys.readouterr().out
    assert code == 0
    assert "top 3 by estimated step time" in out and "assumptions" in out and "rejected:" in out
    assert "MFU" in out and "bubble" in out


@pytest.mark.parametrize("argv, words", [
    (["--model", "llama9", "--gpus", "8", "--global-batch-size", "8"], ["--model", "llama9", "llama3-70b"]),
    (["--model", "llama3-8b", "--gpus", "12", "--global-batch-size", "8"], ["gpus=12", "8 GPUs per node"]),
    (["--model", "llama3-8b", "--gpus", "8", "--global-batch-size", "8", "--seq-length", "200000"],
     ["--seq-length 200000", "131072"]),
    (["--model", "llama3-8b", "--gpus", "8", "--global-batch-size", "8", "--cluster", "tpu"], ["--cluster", "tpu"]),
    # 0 was falsy, and --seq-length 0 planned with the model's 8192
    (["--model", "llama3-8b", "--gpus", "8", "--global-batch-size", "8", "--seq-length", "0"], ["--seq-length 0"]),
    (["--model", "llama3-8b", "--gpus", "8", "--global-batch-size", "8", "--seq-length", "-5"], ["--seq-length -5"]),
    (["--model", "llama3-8b", "--gpus", "0", "--global-batch-size", "8"], ["--gpus 0"]),
    (["--model", "llama3-8b", "--gpus", "-8", "--global-batch-size", "8"], ["--gpus -8"]),
    (["--model", "llama3-8b", "--gpus", "8", "--global-batch-size", "0"], ["--global-batch-size 0"]),
    (["--model", "llama3-8b", "--gpus", "8", "--global-batch-size", "8", "--top", "0"], ["--top 0"]),
    (["--model", "llama3-8b", "--gpus", "8", "--global-batch-size", "8", "--micro-batch-size", "0"],
     ["--micro-batch-size 0"]),
    (["--model", "llama3-8b", "--gpus", "8", "--global-batch-size", "8", "--zero-stage", "4"], ["--zero-stage 4"]),
])
def test_cli_bad_input_exits_2_naming_the_field(capsys, argv, words):
    assert main(argv).exit_code == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err, (word, err)


def test_the_in_flight_peak_beyond_3_pp_micro_batches_is_the_simulated_one():
    """rank_memory._in_flight simulates at most 3 pp micro-batches (a global batch of 10^12
    took minutes): the peak it returns is the full schedule's, for every rank, pp, v and m."""
    from minimegatron.plan.rank_memory import _in_flight
    from minimegatron.pp import peak_in_flight, schedule
    for pp in (2, 3, 4):
        for kind, v in (("1f1b", 1), ("interleaved", 2), ("interleaved", 3)):
            for m in (range(pp, 8 * pp + 1, pp) if kind == "interleaved" else range(1, 8 * pp + 1)):
                for rank in range(pp):
                    assert _in_flight(kind, pp, rank, m, v) == peak_in_flight(schedule(kind, pp, rank, m, v)), \
                        (kind, pp, rank, m, v)


def test_cli_help_and_argparse_errors_exit_as_argparse_does(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0 and "--global-batch-size" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["--model", "tiny"])                                        # --gpus missing
    assert exc.value.code == 2
