"""The training command line as a Megatron-LM user types it: help, groups, switches, batch
arithmetic, flags the book does not implement, and bad values refused by field and value."""

import argparse
import dataclasses

import pytest

from minimegatron.config import ConfigError, ModelConfig, TrainConfig
from minimegatron.arguments import FLAGS, GROUPS, NOT_IN_BOOK, build_parser, configs_from_args
from minimegatron.train import main


def _actions_by_flag(parser):
    return {flag: action for action in parser._actions for flag in action.option_strings}


def _group_of(parser):
    return {flag: group.title for group in parser._action_groups for action in group._group_actions
            for flag in action.option_strings}


def test_every_config_field_is_a_flag_with_a_one_line_help_and_its_default():
    parser = build_parser()
    dests = {a.dest for a in parser._actions}
    for cls in (ModelConfig, TrainConfig):
        for f in dataclasses.fields(cls):
            assert f.name in dests, f"{cls.__name__}.{f.name} has no flag"
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help and "\n" not in action.help, action.option_strings
        if action.dest in FLAGS and action.option_strings[0] in FLAGS[action.dest][1]:
            assert "[default: " in action.help, action.option_strings


def test_flags_sit_in_megatrons_help_groups():
    group = _group_of(build_parser())
    assert set(GROUPS) <= set(group.values())
    for flag, title in [("--hidden-size", "model"), ("--num-query-groups", "model"), ("--swiglu", "model"),
                        ("--untie-embeddings-and-output-weights", "model"), ("--micro-batch-size", "training"),
                        ("--global-batch-size", "training"), ("--lr", "training"),
                        ("--tensor-model-parallel-size", "parallelism"), ("--zero-stage", "parallelism"),
                        ("--distributed-timeout-minutes", "parallelism"), ("--data-path", "data"),
                        ("--seq-length", "data"), ("--save", "checkpointing"), ("--load", "checkpointing")]:
        assert group[flag] == title, (flag, group[flag])


def test_help_prints_the_groups_and_exits_0(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for title in GROUPS:
        assert f"\n{title}:\n" in out
    assert "--sequence-parallel" in out and "chapter 04" in out


def test_booleans_are_switches_as_megatron_spells_them():
    model, _ = configs_from_args(["--style", "gpt2", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
                                  "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope"])
    assert model.untie_embeddings_and_output_weights is True and model.add_bias_linear is False
    assert (model.activation, model.normalization, model.position_embedding_type) == ("swiglu", "RMSNorm", "rope")
    llama, _ = configs_from_args(["--tie-embeddings-and-output-weights", "--add-bias-linear"])
    assert llama.untie_embeddings_and_output_weights is False and llama.add_bias_linear is True
    default, _ = configs_from_args([])                                  # the llama style unties
    assert default.untie_embeddings_and_output_weights is True and default.add_bias_linear is False
    for switch in ("--untie-embeddings-and-output-weights", "--disable-bias-linear", "--swiglu", "--no-progress"):
        assert _actions_by_flag(build_parser())[switch].nargs == 0          # takes no value


def test_megatron_spellings_reach_the_book_fields():
    model, cfg = configs_from_args(["--norm-epsilon", "1e-6", "--save", "a", "--load", "b", "--seed", "7",
                                    "--use-distributed-optimizer", "--lr-decay-style", "cosine",
                                    "--group-query-attention", "--num-query-groups", "2"])
    assert model.layernorm_epsilon == 1e-6 and model.seed == 7 and model.num_query_groups == 2
    assert (cfg.save_dir, cfg.load_dir, cfg.zero_stage) == ("a", "b", 1)
    _, cfg = configs_from_args(["--layernorm-epsilon", "1e-3", "--save-dir", "c", "--load-dir", "d"])   # the book's
    assert (cfg.save_dir, cfg.load_dir) == ("c", "d")


@pytest.mark.parametrize("world, argv, accum", [
    (1, ["--micro-batch-size", "2", "--global-batch-size", "8"], 4),                       # 8 / (2 x 1)
    (4, ["--micro-batch-size", "2", "--global-batch-size", "8"], 1),                       # 8 / (2 x 4)
    (4, ["--micro-batch-size", "1", "--global-batch-size", "8", "--tensor-model-parallel-size", "2"], 4),  # dp 2
    (8, ["--micro-batch-size", "1", "--global-batch-size", "8", "--tensor-model-parallel-size", "2",
         "--pipeline-model-parallel-size", "2"], 4),                                        # dp 2
    (1, ["--micro-batch-size", "2", "--grad-accum-steps", "3"], 3),                        # the book's flag
])
def test_global_batch_size_sets_the_number_of_micro_batches(world, argv, accum):
    _, cfg = configs_from_args(argv, world_size=world)
    assert cfg.grad_accum_steps == accum


@pytest.mark.parametrize("world, argv, words", [
    (2, ["--micro-batch-size", "2", "--global-batch-size", "6"],
     ["global_batch_size=6", "micro_batch_size=2", "data-parallel size 2"]),
    (1, ["--micro-batch-size", "2", "--global-batch-size", "8", "--grad-accum-steps", "2"],
     ["global_batch_size=8", "4 micro-batches", "grad_accum_steps=2"]),
    (3, ["--global-batch-size", "8", "--tensor-model-parallel-size", "2"],
     ["world size 3", "tensor_model_parallel_size=2"]),
])
def test_a_global_batch_size_that_does_not_divide_is_refused_with_the_numbers(world, argv, words):
    with pytest.raises(ConfigError) as info:
        configs_from_args(argv, world_size=world)
    for w in words:
        assert w in str(info.value)


@pytest.mark.parametrize("argv, words", [
    (["--sequence-parallel"], ["sequence_parallel", "tensor_model_parallel_size=1", "tp > 1"]),
    (["--context-parallel-size", "2"], ["world size 1", "context_parallel_size=2", "--nproc_per_node=2"]),
    (["--cp-comm-type", "ring"], ["cp_comm_type='ring'", "p2p, all_gather, a2a, a2a+p2p"]),
    (["--cp-comm-type", "p2p", "--hierarchical-context-parallel-sizes", "2", "2"],
     ["hierarchical_context_parallel_sizes=[2, 2]", "a2a+p2p"]),
    (["--expert-model-parallel-size", "2"], ["expert_model_parallel_size=2", "a model without experts"]),
    (["--num-experts", "4", "--expert-model-parallel-size", "3"],
     ["num_experts=4", "not divisible by expert_model_parallel_size=3"]),
    (["--num-experts", "4", "--moe-token-dispatcher-type", "flex"], ["moe_token_dispatcher_type='flex'"]),
    (["--num-experts", "4", "--moe-router-topk", "5"], ["moe_router_topk=5", "num_experts=4"]),
    (["--fp8-param-gather"], ["--fp8-param-gather", "not in this book"]),
    (["--transformer-impl", "transformer_engine"], ["--transformer-impl", "check_fp8_te.py"]),
    (["--fp8-format", "e5m2"], ["fp8_format='e5m2'", "'hybrid' or 'e4m3'"]),
    (["--fp8-format", "hybrid", "--fp8-recipe", "nvfp4"], ["fp8_recipe='nvfp4'", "tensorwise, delayed, blockwise, mxfp8"]),
    (["--bf16", "--fp16"], ["bf16 and fp16 are both set"]),
    (["--bf16", "--params-dtype", "float32"], ["bf16 needs the model's params_dtype='bfloat16'", "'float32'"]),
    (["--grad-reduce-in-bf16"], ["grad_reduce_in_bf16 needs bf16"]),
    (["--fp16", "--min-loss-scale", "8", "--initial-loss-scale", "4"], ["min_loss_scale=8.0", "initial_loss_scale=4.0"]),
    (["--fp16", "--hysteresis", "0"], ["hysteresis=0 must be >= 1"]),
    (["--bf16", "--ddp-impl", "naive"], ["float32 buffer", "ddp_impl='naive'"]),
    (["--hidden-sise", "64"], ["unknown flag --hidden-sise", "did you mean --hidden-size?"]),
    (["--untie-embeddings-and-output-weights", "maybe"],
     ["--untie-embeddings-and-output-weights is a switch", "'maybe'"]),
    (["--untie-embeddings-and-output-weights=maybe"], ["--untie-embeddings-and-output-weights", "'maybe'"]),
    (["--adam-beta1", "2"], ["adam_beta1=2.0", "[0, 1)"]),
    (["--adam-beta2", "-0.5"], ["adam_beta2=-0.5"]),
    (["--adam-eps", "-1"], ["adam_eps=-1.0"]),
    (["--data-seed", "-1"], ["data_seed=-1"]),
    (["--layernorm-epsilon", "-1"], ["layernorm_epsilon=-1.0"]),
    (["--norm-epsilon", "0"], ["layernorm_epsilon=0.0"]),
    (["--rotary-base", "0"], ["rotary_base=0.0"]),
    (["--init-method-std", "-1"], ["init_method_std=-1.0"]),
    (["--num-query-groups", "0"], ["num_query_groups=0"]),
    (["--weight-decay", "-1"], ["weight_decay=-1.0"]),
    (["--save-interval", "-2"], ["save_interval=-2"]),
    (["--lr-warmup-fraction", "1.5"], ["lr_warmup_fraction=1.5"]),
    (["--distributed-timeout-minutes", "0"], ["distributed_timeout_minutes=0"]),
    (["--zero-stage", "one"], ["--zero-stage", "'one'"]),
])
def test_bad_command_lines_are_refused_by_name_and_value(argv, words, capsys, tmp_path):
    """Each used to end in a traceback, train to NaN, or be taken silently (issue 11 §7)."""
    assert main(argv + ["--out-dir", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    for w in words:
        assert w in err, (w, err)
    assert not (tmp_path / "loss.png").exists()


def test_every_refused_megatron_flag_says_why():
    for flag, reason in NOT_IN_BOOK.items():
        with pytest.raises(ConfigError, match=f"^{flag}: "):
            configs_from_args([flag])
        assert "chapter" in reason or "not in this book" in reason


def test_a_preset_warm_up_scales_with_train_iters():
    """tiny warms up for 4 of its 40 steps: --train-iters 3 used to fail on lr_warmup_iters=4."""
    assert configs_from_args([])[1].lr_warmup_iters == 4
    assert configs_from_args(["--train-iters", "3"])[1].lr_warmup_iters == 0          # 4 x 3 // 40
    assert configs_from_args(["--train-iters", "80"])[1].lr_warmup_iters == 8
    assert configs_from_args(["--preset", "demo", "--train-iters", "30"])[1].lr_warmup_iters == 3   # 30 of 300
    assert configs_from_args(["--train-iters", "3", "--lr-warmup-iters", "2"])[1].lr_warmup_iters == 2
    assert configs_from_args(["--train-iters", "8", "--lr-warmup-fraction", "0.25"])[1].lr_warmup_iters == 2
    with pytest.raises(ConfigError, match="not both"):
        configs_from_args(["--lr-warmup-iters", "2", "--lr-warmup-fraction", "0.25"])


def test_preset_tiny_with_three_steps_trains(tmp_path, capsys):
    assert main(["--preset", "tiny", "--train-iters", "3", "--eval-interval", "0", "--no-progress",
                 "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "global batch 4 sequences = micro_batch_size 4 x 1 micro-batches x data-parallel size 1" in out
    assert "final train loss" in out


def test_data_with_token_ids_beyond_the_vocabulary_stops_before_training(tmp_path, capsys):
    """The embedding would raise IndexError mid-step; the dataset is refused when opened."""
    import numpy as np

    from minimegatron.data import IndexedDatasetBuilder
    prefix = tmp_path / "corpus"
    with IndexedDatasetBuilder(prefix, np.uint16) as builder:
        for doc in range(20):
            builder.add_document([(doc * 7 + i) % 257 for i in range(40)] + ([1000] if doc == 3 else []))
    assert main(["--data-path", str(prefix), "--out-dir", str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "token id 1000 (document 3)" in err and "[0, 257)" in err


def test_a_config_field_without_its_command_line_is_refused_by_name(monkeypatch):
    """Each field declares its flags, group and help once, in config.py (config.opt): a field
    declared without them stops the parser from being built, naming the field."""
    import minimegatron.arguments as arguments
    bare = dataclasses.fields(dataclasses.make_dataclass("Bare", [("widget_count", int, dataclasses.field(default=1))]))
    monkeypatch.setitem(arguments.FIELDS, "widget_count", bare[0])
    with pytest.raises(RuntimeError, match="widget_count has no command line"):
        build_parser()
