"""The command line of `python -m minimegatron.train`, as a Megatron-LM user expects it
(Megatron's is megatron/training/arguments.py): every config field a flag with a one-line
help, grouped as Megatron's --help groups them, Megatron's spellings for what the book
implements, switches for booleans, --global-batch-size, and Megatron flags the book does
not implement refused with the reason.

    model_cfg, train_cfg, cli = parse_command_line(argv, world_size)
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from typing import Any, Iterable

from .config import ConfigError, ModelConfig, TrainConfig

# ---------------------------------------------------------------------------------------
# presets: sizes that train in seconds to a minute on a laptop CPU
# ---------------------------------------------------------------------------------------
PRESETS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # (model overrides, train overrides); the model style is LLaMA unless --style gpt2. A
    # preset's lr_warmup_iters is a share of its train_iters: on the command line, another
    # --train-iters scales it (parse_command_line), unless --lr-warmup-iters is given too.
    "tiny": (dict(hidden_size=32, num_layers=2, num_attention_heads=4, max_position_embeddings=32),
             dict(seq_length=32, micro_batch_size=4, train_iters=40, eval_interval=20, lr_warmup_iters=4)),
    "demo": (dict(hidden_size=96, num_layers=3, num_attention_heads=6, num_query_groups=2,
                  max_position_embeddings=64),
             dict(seq_length=64, micro_batch_size=8, train_iters=300, eval_interval=50, lr_warmup_iters=30,
                  out_dir="runs/demo")),
}



# ---------------------------------------------------------------------------------------
# command line: Megatron-LM's flags, where the book implements what they do
# ---------------------------------------------------------------------------------------
# Every config field is a flag in one of the groups of Megatron's --help, with a one-line help
# saying its unit; the default is appended from the configs themselves. The first name of a
# flag is Megatron's spelling (checked 2026-11-24 against Megatron-LM main: the flags
# megatron/training/arguments.py adds, and those it generates from TransformerConfig,
# TrainingConfig, SchedulerConfig, CheckpointConfig, RNGConfig); more names are the book's.
GROUPS = ("model", "moe", "training", "mixed precision", "parallelism", "data", "checkpointing", "logging")

# field -> (group, flag names, help). Booleans are switches (SWITCHES below), not flags.
FLAGS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "vocab_size": ("model", ("--vocab-size",), "rows of the embedding table, in tokens (>= the tokenizer's size)"),
    "make_vocab_size_divisible_by": ("model", ("--make-vocab-size-divisible-by",),
                                     "with TP, pad the vocabulary to a multiple of this x tp (Megatron: 128, "
                                     "padding on one device too)"),
    "hidden_size": ("model", ("--hidden-size",), "h, the width of the residual stream"),
    "num_layers": ("model", ("--num-layers",), "L, transformer layers"),
    "num_attention_heads": ("model", ("--num-attention-heads",), "a, query heads"),
    "num_query_groups": ("model", ("--num-query-groups",),
                         "g, key/value heads (grouped-query attention); unset: g = a"),
    "ffn_hidden_size": ("model", ("--ffn-hidden-size",),
                        "f, the MLP's inner width; unset: 4h (GELU), about 8h/3 (SwiGLU)"),
    "max_position_embeddings": ("model", ("--max-position-embeddings",), "longest sequence the model accepts, tokens"),
    "normalization": ("model", ("--normalization",), "LayerNorm or RMSNorm"),
    "activation": ("model", ("--activation",), "the MLP's activation, gelu or swiglu (the book's; Megatron: --swiglu)"),
    "position_embedding_type": ("model", ("--position-embedding-type",), "learned_absolute or rope"),
    "rotary_base": ("model", ("--rotary-base",), "RoPE's base theta, > 0"),
    "layernorm_epsilon": ("model", ("--norm-epsilon", "--layernorm-epsilon"),
                          "epsilon added to the variance in LayerNorm / RMSNorm, > 0"),
    "init_method_std": ("model", ("--init-method-std",), "standard deviation of the normal initial weights, > 0"),
    "hidden_dropout": ("model", ("--hidden-dropout",), "dropout probability on the residual branches, in [0, 1)"),
    "attention_dropout": ("model", ("--attention-dropout",),
                          "dropout probability on the attention probabilities, in [0, 1)"),
    "attention_backend": ("model", ("--attention-backend",),
                          "how attention is computed (the book's implementations, see minimegatron/model)"),
    "seed": ("model", ("--seed",), "initial weights: each parameter is a function of (seed, its name); "
                                   "Megatron's --seed also seeds data and dropout, here --data-seed does"),
    "params_dtype": ("model", ("--params-dtype",),
                     "dtype of parameters and activations: float32, float64, bfloat16 or float16, plain (no "
                     "float32 main copies: --bf16 / --fp16 are mixed precision) (the book's)"),
    "num_experts": ("moe", ("--num-experts",), "E, experts in each MoE layer; unset: a dense MLP everywhere "
                                               "(chapter 05)"),
    "moe_router_topk": ("moe", ("--moe-router-topk",), "k, experts each token is routed to"),
    "moe_ffn_hidden_size": ("moe", ("--moe-ffn-hidden-size",), "an expert's inner width; unset: --ffn-hidden-size"),
    "moe_layer_freq": ("moe", ("--moe-layer-freq",), "every n-th layer (layer i with i %% n == 0) is an MoE layer"),
    "moe_shared_expert_intermediate_size": ("moe", ("--moe-shared-expert-intermediate-size",),
                                            "inner width of a shared expert every token also takes; unset: none"),
    "moe_router_score_function": ("moe", ("--moe-router-score-function",), "softmax or sigmoid"),
    "moe_aux_loss_coeff": ("moe", ("--moe-aux-loss-coeff",), "weight of the load-balancing loss, >= 0"),
    "moe_z_loss_coeff": ("moe", ("--moe-z-loss-coeff",), "weight of the router z-loss, >= 0"),
    "moe_expert_capacity_factor": ("moe", ("--moe-expert-capacity-factor",),
                                   "slots per expert = ceil(tokens x k / E x factor), the rest dropped; unset: "
                                   "no capacity"),
    "moe_token_drop_policy": ("moe", ("--moe-token-drop-policy",),
                              "which tokens a full expert keeps: probs (the largest weights) or position (the first)"),
    "moe_router_load_balancing_type": ("moe", ("--moe-router-load-balancing-type",),
                                       "aux_loss (over the micro-batch's tokens) or seq_aux_loss (per sequence, "
                                       "averaged)"),
    "moe_router_bias_update_rate": ("moe", ("--moe-router-bias-update-rate",),
                                    "with --moe-router-enable-expert-bias: the bias's step per training step"),
    "moe_token_dispatcher_type": ("moe", ("--moe-token-dispatcher-type",),
                                  "how tokens reach the ranks of their experts: alltoall or allgather"),
    "expert_model_parallel_size": ("parallelism", ("--expert-model-parallel-size",),
                                   "ep, ranks the experts of a layer are spread over (chapter 05); expert dp = "
                                   "world size / (etp x ep x pp)"),
    "expert_tensor_parallel_size": ("parallelism", ("--expert-tensor-parallel-size",),
                                    "etp, ranks each expert's matrices are cut over (chapter 05); unset: tp"),
    "loss_scale": ("mixed precision", ("--loss-scale",), "a constant loss scale (a power of 2); unset: dynamic "
                                                        "with --fp16, none with --bf16 (chapter 06)"),
    "initial_loss_scale": ("mixed precision", ("--initial-loss-scale",), "--fp16's dynamic loss scale to start from"),
    "min_loss_scale": ("mixed precision", ("--min-loss-scale",), "the dynamic loss scale never drops below this"),
    "loss_scale_window": ("mixed precision", ("--loss-scale-window",),
                          "clean steps in a row after which the dynamic loss scale doubles"),
    "hysteresis": ("mixed precision", ("--hysteresis",),
                   "overflowing steps before the dynamic loss scale halves (refilled only when it grows)"),
    "fp8_format": ("mixed precision", ("--fp8-format",), "the transformer layers' GEMMs in FP8: hybrid (e4m3 "
                                                          "forward, e5m2 output gradients) or e4m3; unset: no FP8 "
                                                          "(chapter 06)"),
    "fp8_recipe": ("mixed precision", ("--fp8-recipe",), "how FP8 tensors are scaled: tensorwise, delayed, blockwise "
                                                         "or mxfp8"),
    "fp8_margin": ("mixed precision", ("--fp8-margin",), "delayed scaling: scale = fp8_max / amax / 2^margin"),
    "fp8_amax_history_len": ("mixed precision", ("--fp8-amax-history-len",),
                             "delayed scaling: amaxes remembered per tensor role (at most 1024, Transformer "
                             "Engine's default, or the run's train_iters x grad_accum_steps)"),
    "fp8_amax_compute_algo": ("mixed precision", ("--fp8-amax-compute-algo",),
                              "delayed scaling: the scale from the latest amax (most_recent) or the history's max"),
    "kernels": ("training", ("--kernels",), "torch; triton: the norms, FlashAttention-2, SwiGLU and the loss as Triton "
                                            "kernels (interpreted on a CPU: for reading, not speed); compile: each layer "
                                            "through torch.compile (chapter 07) (the book's)"),
    "recompute_granularity": ("training", ("--recompute-granularity",),
                              "activation recompute (chapter 07): full (whole layers, in units) or selective "
                              "(the parts --recompute-modules names); unset: none"),
    "recompute_method": ("training", ("--recompute-method",),
                         "full recompute: uniform (every --recompute-num-layers layers one unit) or block (the "
                         "first --recompute-num-layers layers of each chunk)"),
    "recompute_num_layers": ("training", ("--recompute-num-layers",),
                             "full recompute: layers per unit (uniform) or recomputed layers per chunk (block)"),
    "recompute_modules": ("training", ("--recompute-modules",),
                          "selective recompute: any of core_attn, mlp, moe, moe_act, layernorm"),
    "profile_step_start": ("logging", ("--profile-step-start",),
                           "with --profile: the first step recorded, counted from 0 (chapter 07)"),
    "profile_step_end": ("logging", ("--profile-step-end",), "with --profile: the step the recording stops before"),
    "profile_ranks": ("logging", ("--profile-ranks",), "with --profile: the ranks that profile; unset: all"),
    "micro_batch_size": ("training", ("--micro-batch-size",), "b, sequences per micro-batch on one data-parallel rank"),
    "grad_accum_steps": ("training", ("--grad-accum-steps",),
                         "M, micro-batches per step on each data-parallel rank (the book's name; Megatron "
                         "derives M from --global-batch-size)"),
    "train_iters": ("training", ("--train-iters",), "optimizer steps"),
    "lr": ("training", ("--lr",), "peak learning rate, reached at the end of warm-up"),
    "min_lr": ("training", ("--min-lr",), "learning rate at the end of the cosine decay"),
    "lr_warmup_iters": ("training", ("--lr-warmup-iters",), "steps of linear warm-up to --lr"),
    "weight_decay": ("training", ("--weight-decay",), "AdamW's decoupled weight decay on matrices, >= 0"),
    "adam_beta1": ("training", ("--adam-beta1",), "Adam's first-moment decay, in [0, 1)"),
    "adam_beta2": ("training", ("--adam-beta2",), "Adam's second-moment decay, in [0, 1)"),
    "adam_eps": ("training", ("--adam-eps",), "Adam's epsilon in the denominator, > 0"),
    "adam_impl": ("training", ("--adam-impl",), "torch's AdamW kernels: default (a loop over the tensors on a CPU), "
                                               "foreach (each op over all tensors at once) or fused (one kernel; "
                                               "Megatron uses Transformer Engine's or Apex's FusedAdam) (the book's)"),
    "clip_grad": ("training", ("--clip-grad",), "clip the global gradient L2 norm to this; 0: no clipping"),
    "eval_interval": ("training", ("--eval-interval",), "steps between validation runs; 0: never"),
    "eval_iters": ("training", ("--eval-iters",), "validation batches per validation run"),
    "device": ("training", ("--device",), "cpu (gloo, the tested path) or cuda (NCCL, one GPU per rank) (the book's)"),
    "tensor_model_parallel_size": ("parallelism", ("--tensor-model-parallel-size",),
                                   "tp, ranks each matrix is split over (chapter 02)"),
    "pipeline_model_parallel_size": ("parallelism", ("--pipeline-model-parallel-size",),
                                     "pp, pipeline stages (chapter 03); dp = world size / (tp x pp)"),
    "num_virtual_stages_per_pipeline_rank": ("parallelism", ("--num-virtual-stages-per-pipeline-rank",),
                                             "model chunks per pipeline rank; > 1 with --pipeline-schedule "
                                             "interleaved"),
    "pipeline_schedule": ("parallelism", ("--pipeline-schedule",),
                          "gpipe, 1f1b or interleaved (the book's; Megatron runs 1F1B, interleaved with "
                          "virtual stages)"),
    "context_parallel_size": ("parallelism", ("--context-parallel-size",),
                              "cp, ranks each sequence is split over (chapter 04); dp = world size / (tp x cp x pp)"),
    "cp_comm_type": ("parallelism", ("--cp-comm-type",),
                     "how attention reaches the other cp ranks' keys: p2p (ring), all_gather, a2a (Ulysses) or "
                     "a2a+p2p (hierarchical) (chapter 04)"),
    "hierarchical_context_parallel_sizes": ("parallelism", ("--hierarchical-context-parallel-sizes",),
                                            "with --cp-comm-type a2a+p2p: the all-to-all size and the ring size, "
                                            "product cp; unset: 2 and cp / 2"),
    "zero_stage": ("parallelism", ("--zero-stage",), "ZeRO stage over data parallelism: 0 replicated, 1 optimizer "
                                                     "state, 2 + gradients, 3 + parameters sharded (chapter 01; the book's)"),
    "ddp_impl": ("parallelism", ("--ddp-impl",), "with --zero-stage 0: naive (an all-reduce per gradient) or "
                                                 "bucketed (overlapped with backward) (the book's)"),
    "ddp_bucket_size": ("parallelism", ("--ddp-bucket-size",),
                        "elements per gradient bucket; unset: Megatron's max(4e7, 1e6 x dp)"),
    "data_path": ("data", ("--data-path",), "prefix of a .bin/.idx pair (python tools/preprocess_data.py); "
                                            "unset: this repository's text, tokenized"),
    "tokenizer": ("data", ("--tokenizer",), "byte, or the path of a BPE tokenizer .json (the book's)"),
    "seq_length": ("data", ("--seq-length",), "s, tokens per sequence"),
    "data_seed": ("data", ("--data-seed",), "seeds the data order and the dropout masks, >= 0 (the book's)"),
    "save_dir": ("checkpointing", ("--save", "--save-dir"), "directory to save checkpoints to; unset: no checkpoints"),
    "load_dir": ("checkpointing", ("--load", "--load-dir"),
                 "directory to resume from (its `latest`); without a checkpoint there: a warning, then a fresh start"),
    "save_interval": ("checkpointing", ("--save-interval",), "steps between checkpoints; 0: at the end only"),
    "ckpt_format": ("checkpointing", ("--ckpt-format",),
                    "torch: a file per rank, resumed under the same layout only (the book's default); torch_dist: "
                    "each piece with its global offsets, resumed under any layout (Megatron's default; chapter 08)"),
    "exit_interval": ("checkpointing", ("--exit-interval",), "stop after an iteration divisible by it, saving first"),
    "out_dir": ("checkpointing", ("--out-dir",), "directory of the loss log and plot (the book's)"),
}

# field -> [(switch, value it stores, help)]: Megatron's switch first, the book's opposite after
SWITCHES: dict[str, list[tuple[str, Any, str]]] = {
    "untie_embeddings_and_output_weights": [
        ("--untie-embeddings-and-output-weights", True, "a separate output layer instead of the embedding's transpose"),
        ("--tie-embeddings-and-output-weights", False, "the output layer is the embedding's transpose (the book's)")],
    "add_bias_linear": [
        ("--disable-bias-linear", False, "no biases in the linear layers"),
        ("--add-bias-linear", True, "biases in the linear layers (the book's)")],
    "activation": [("--swiglu", "swiglu", "SwiGLU MLP, the same as --activation swiglu")],
    "profile": [("--profile", True, "torch.profiler over --profile-step-start .. --profile-step-end: a Chrome trace per "
                                    "rank in <out-dir>/torch_profile/ and rank 0's top operators (chapter 07)")],
    "reset_position_ids": [("--reset-position-ids", True, "positions count from 0 after each <eod> (chapter 07)")],
    "reset_attention_mask": [("--reset-attention-mask", True,
                              "each token attends only to the tokens of its own document (chapter 07)")],
    "eod_mask_loss": [("--eod-mask-loss", True, "no loss where the input token is <eod> (chapter 07)")],
    "recompute_granularity": [("--recompute-activations", "selective",
                               "selective recompute of --recompute-modules (Megatron's older switch)")],
    "progress": [("--no-progress", False, "no progress bar (the book's)"),
                 ("--progress", True, "a progress bar on rank 0 (the book's)")],
    "moe_router_pre_softmax": [("--moe-router-pre-softmax", True, "softmax over all experts before the top-k "
                                                                  "(default: over the chosen k after it)")],
    "moe_router_enable_expert_bias": [("--moe-router-enable-expert-bias", True,
                                       "DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias for the "
                                       "choice, updated after each step (needs sigmoid scores)")],
    "kernels": [("--compile", "compile", "each transformer layer through torch.compile, the same as --kernels compile "
                                         "(chapter 07) (the book's)")],
    "overlap_grad_reduce": [("--overlap-grad-reduce", True, "ZeRO-1/2: launch each bucket's reduce-scatter from the "
                                                              "backward as soon as it is complete (the bucketed DDP "
                                                              "always overlaps its all-reduces; chapter 07)")],
    "overlap_param_gather": [("--overlap-param-gather", True, "ZeRO-1/2: the parameter all-gathers launched after the "
                                                                "step, waited module by module in the next forward "
                                                                "(needs --overlap-grad-reduce; chapter 07)")],
    "no_load_optim": [("--no-load-optim", True, "torch_dist: load the model only; the optimizer starts fresh")],
    "no_load_rng": [("--no-load-rng", True, "torch_dist: do not restore the random states; seed them afresh")],
    "finetune": [("--finetune", True, "torch_dist: load the model only and start from iteration 0 (no optimizer, "
                                       "random states or history)")],
    "overlap_p2p_comm": [("--overlap-p2p-communication", True, "with pp > 1: each receive posted one op ahead, so it "
                                                               "arrives while the stage computes (chapter 07) (the book's; "
                                                               "Megatron has only --no-overlap-p2p-communication, "
                                                               "overlapping by default)"),
                         ("--no-overlap-p2p-communication", False, "receives posted when needed (the book's default; "
                                                                   "Megatron overlaps by default with interleaving)")],
    "overlap_sp_backward": [("--overlap-sp-backward", True, "with --sequence-parallel: the column-parallel backward's "
                                                             "all-gather and reduce-scatter run behind its GEMMs, as "
                                                             "Megatron's layer always does, with no flag (chapter 07) "
                                                             "(the book's)")],
    "sequence_parallel": [("--sequence-parallel", True, "with tp > 1: norms, dropout and residuals hold s/tp tokens "
                                                         "per rank; all-gather / reduce-scatter replace the all-reduces "
                                                         "(chapter 04)")],
    "bf16": [("--bf16", True, "bfloat16 mixed precision: bf16 parameters and activations, float32 main parameters "
                              "and gradients in the optimizer (sets --params-dtype bfloat16; chapter 06)")],
    "fp16": [("--fp16", True, "float16 mixed precision with loss scaling: fp16 parameters and activations, float32 "
                              "main parameters (sets --params-dtype float16; chapter 06)")],
    "accumulate_allreduce_grads_in_fp32": [("--accumulate-allreduce-grads-in-fp32", True,
                                            "accumulate and reduce the gradients in float32 (always with --bf16)")],
    "grad_reduce_in_bf16": [("--grad-reduce-in-bf16", True, "with --bf16: accumulate and reduce the gradients in "
                                                            "bfloat16 instead")],
    "zero_stage": [("--use-distributed-optimizer", 1, "Megatron's distributed optimizer: the book's --zero-stage 1")],
}

PRECISION_SWITCHES = ("bf16", "fp16", "accumulate_allreduce_grads_in_fp32", "grad_reduce_in_bf16")

# Flags that exist only on the command line (not config fields): name -> (group, add_argument kwargs)
CLI_ONLY: dict[str, tuple[str, dict[str, Any]]] = {
    "--global-batch-size": ("training", dict(type=int, help="sequences per optimizer step over all data-parallel "
                                             "ranks; sets M = global / (micro x dp), which must divide [default: "
                                             "--grad-accum-steps decides]")),
    "--lr-warmup-fraction": ("training", dict(type=float, help="warm-up as a fraction of --train-iters, in [0, 1] "
                                              "(instead of --lr-warmup-iters) [default: unset]")),
    "--lr-decay-style": ("training", dict(choices=["cosine"], help="the book decays with a cosine to --min-lr "
                                          "[default: cosine, the only one]")),
    "--distributed-timeout-minutes": ("parallelism", dict(type=float, default=1.0, help=(
        "minutes a collective may wait for another rank before the job fails with a 'timed out' error, on every "
        "process group [default: 1, the book's; Megatron: 10]"))),
    "--group-query-attention": ("model", dict(action="store_true", help=(
        "accepted as Megatron spells it; here --num-query-groups alone sets g"))),
    "--use-pytorch-profiler": ("logging", dict(action="store_true", help=(
        "accepted as Megatron spells it; the book's --profile always uses torch.profiler (Megatron's default is "
        "Nsight Systems, which needs a GPU)"))),
}

# Megatron-LM flags for what the book does not (yet) do: refused with the reason, by name
NOT_IN_BOOK: dict[str, str] = {
    "--fp8-param-gather": "not in this book: FP8 parameters stay in the model's dtype (only the GEMMs' operands are "
                          "cast)",
    "--transformer-impl": "not in this book: its layers are the book's own (Megatron's 'local'); FP8 is emulated by "
                          "fp8/linear.py; benchmarks/check_fp8_te.py compares it with Transformer Engine on a GPU",
    "--use-flash-attn": "not in this book, and legacy in Megatron-LM, where nothing reads it any more (its "
                        "--attention-backend chooses the kernel); here --attention-backend picks the book's",
    "--num-layers-per-virtual-pipeline-stage": "not in this book: give --num-virtual-stages-per-pipeline-rank",
    "--kv-channels": "not in this book: the head size is always hidden_size / num_attention_heads",
    "--tokenizer-type": "not in this book: --tokenizer byte or --tokenizer PATH.json chooses the tokenizer",
    "--vocab-file": "not in this book: --tokenizer PATH.json gives a BPE tokenizer",
    "--merge-file": "not in this book: --tokenizer PATH.json gives a BPE tokenizer",
    "--tokenizer-model": "not in this book: --tokenizer PATH.json gives a BPE tokenizer",
    "--split": "not in this book: the last 10%% of the documents are the validation set",
    "--mock-data": "not in this book: without --data-path the run trains on this repository's text",
    "--lr-decay-iters": "not in this book: the cosine decays over --train-iters",
}


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors raised as ConfigError (main prints them and returns 2)."""

    def error(self, message: str):
        raise ConfigError(f"{message} (python -m minimegatron.train --help lists every flag)")


class _NotInBook(argparse.Action):
    """A Megatron-LM flag the book does not implement: refused, saying why."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest=argparse.SUPPRESS, nargs="?", default=argparse.SUPPRESS,
                         metavar="VALUE", **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        raise ConfigError(f"{option_string}: " + self.help.replace("%%", "%"))


def _shown(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def _defaults(field_name: str) -> str:
    """'[default: X]' for `python -m minimegatron.train` (preset tiny, --style llama), plus the
    values the other preset or style give where they differ."""
    configs = {(preset, style): (getattr(ModelConfig, style)(**PRESETS[preset][0]), TrainConfig(**PRESETS[preset][1]))
               for preset in PRESETS for style in ("llama", "gpt2")}
    def value(key):
        model, train_cfg = configs[key]
        return getattr(model if hasattr(model, field_name) else train_cfg, field_name)
    base = value(("tiny", "llama"))
    others = [f"--preset {p}: {_shown(value((p, 'llama')))}" for p in PRESETS if value((p, "llama")) != base]
    if value(("tiny", "gpt2")) != base:
        others.append(f"--style gpt2: {_shown(value(('tiny', 'gpt2')))}")
    return f"[default: {_shown(base)}" + "".join(f"; {o}" for o in others) + "]"


def _field_kind(f: dataclasses.Field) -> type:
    return {"int": int, "float": float, "str": str, "bool": bool}.get(str(f.type).replace(" | None", "").strip("'"), str)


def build_parser() -> argparse.ArgumentParser:
    """The parser of `python -m minimegatron.train`: every ModelConfig / TrainConfig field is a
    flag (FLAGS, SWITCHES) in one of Megatron's groups; CLI_ONLY adds the command-line-only
    ones; NOT_IN_BOOK refuses Megatron flags the book does not implement. Every value
    defaults to None ("not given") so that presets apply underneath."""
    parser = _Parser(prog="python -m minimegatron.train", description=__doc__.split("\n\n")[0],
                     usage="%(prog)s [--preset {tiny,demo}] [--style {llama,gpt2}] [FLAG VALUE | SWITCH ...]",
                     formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
                     epilog="Flags and switches are spelled as in Megatron-LM (checked 2026-11-24), except those "
                            "marked (the book's)\nand the second names --layernorm-epsilon, --save-dir, --load-dir. "
                            "A preset sets the sizes;\nany flag given overrides it.")
    groups = {"presets": parser.add_argument_group("presets")}
    groups["presets"].add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                                   help="model and run sizes that train in seconds (tiny) to minutes (demo); a "
                                        "preset's warm-up scales with --train-iters [default: tiny]")
    groups["presets"].add_argument("--style", choices=["llama", "gpt2"], default="llama",
                                   help="llama: RMSNorm, SwiGLU, RoPE, no biases, untied; gpt2: LayerNorm, GELU, "
                                        "learned positions, biases, tied [default: llama]")
    for title in GROUPS:
        groups[title] = parser.add_argument_group(title)
    fields = [f for cls in (ModelConfig, TrainConfig) for f in dataclasses.fields(cls)]
    missing = [f.name for f in fields if f.name not in FLAGS and f.name not in SWITCHES]
    if missing:
        raise RuntimeError(f"config field(s) without a flag in arguments.FLAGS: {', '.join(missing)}")
    for f in fields:
        if f.name in FLAGS:
            title, names, text = FLAGS[f.name]
            kind = ({"hierarchical_context_parallel_sizes": dict(type=int, nargs=2),
                     "recompute_modules": dict(type=str, nargs="+"),
                     "profile_ranks": dict(type=int, nargs="+")}.get(f.name) or dict(type=_field_kind(f)))
            groups[title].add_argument(*names, dest=f.name, default=None, metavar=f.name.upper(),
                                       help=f"{text} {_defaults(f.name)}", **kind)
        for switch, value, text in SWITCHES.get(f.name, []):
            title = (FLAGS[f.name][0] if f.name in FLAGS else "model" if hasattr(ModelConfig, f.name) else
                     "mixed precision" if f.name in PRECISION_SWITCHES else "training")
            shown = f" {_defaults(f.name)}" if f.name not in FLAGS and value is True else ""
            groups[title].add_argument(switch, dest=f.name, action="store_const", const=value, default=None,
                                       help=text + shown)
    for flag, (title, kwargs) in CLI_ONLY.items():
        groups[title].add_argument(flag, **kwargs)
    refused = parser.add_argument_group("Megatron-LM flags this book does not implement (refused with the reason)")
    for flag, reason in NOT_IN_BOOK.items():
        refused.add_argument(flag, action=_NotInBook, help=reason)
    return parser


def _explain_leftovers(extra: list[str], argv: list[str], parser: argparse.ArgumentParser) -> str:
    """The message for what argparse could not place: an unknown flag (with the nearest known
    one) or a value after a switch, which takes none."""
    import difflib
    token = extra[0]
    if token.startswith("-"):
        name = token.split("=", 1)[0]
        near = difflib.get_close_matches(name, list(parser._option_string_actions), n=1)
        return f"unknown flag {name}" + (f"; did you mean {near[0]}?" if near else "")
    switches = {flag: a for flag, a in parser._option_string_actions.items() if a.nargs == 0}
    before = next((argv[i - 1] for i, t in enumerate(argv) if t == token and i > 0 and argv[i - 1] in switches),
                  None)
    action = switches.get(before or "")
    if action is not None:
        other = [s for s, _, _ in SWITCHES.get(action.dest, []) if s != before]
        return (f"{before} is a switch and takes no value, got {token!r}: give {before} alone" +
                (f" (its opposite: {' or '.join(other)})" if other else ""))
    return f"unexpected argument {token!r}"


def parse_command_line(argv: Iterable[str] | None = None,
                       world_size: int | None = None) -> tuple[ModelConfig, TrainConfig, dict[str, Any]]:
    """(model config, train config, command-line-only values) from the flags.

    Order: the preset, then the style, then the flags given. A preset's lr_warmup_iters is a
    fraction of its train_iters: given --train-iters without --lr-warmup-iters, the warm-up
    scales with it (tiny: 4 of 40 steps, so 10%). --global-batch-size G sets grad_accum_steps
    = G / (micro_batch_size x dp), dp = world_size / (tp x pp) (WORLD_SIZE of torchrun by
    default). ConfigError for anything that does not fit, naming the flag and the value."""
    argv = list(sys.argv[1:] if argv is None else argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    parser = build_parser()
    namespace, extra = parser.parse_known_args(argv)
    if extra:
        raise ConfigError(_explain_leftovers(extra, argv, parser) + " (python -m minimegatron.train --help lists "
                                                                     "every flag)")
    args = vars(namespace)
    cli = {name.lstrip("-").replace("-", "_"): args.pop(name.lstrip("-").replace("-", "_"))
           for name in CLI_ONLY}
    model_over, train_over = PRESETS[args.pop("preset")]
    train_over = dict(train_over)
    style = args.pop("style")
    model_names = {f.name for f in dataclasses.fields(ModelConfig)}
    given = {k: v for k, v in args.items() if v is not None}
    for name in ("hierarchical_context_parallel_sizes", "recompute_modules", "profile_ranks"):
        if name in given:
            given[name] = tuple(given[name])
    _refuse_ignored_flags(given)
    if "train_iters" in given and "lr_warmup_iters" not in given and "lr_warmup_iters" in train_over:
        train_over["lr_warmup_iters"] = train_over["lr_warmup_iters"] * given["train_iters"] // train_over["train_iters"]
    if cli["lr_warmup_fraction"] is not None:
        fraction = cli["lr_warmup_fraction"]
        if "lr_warmup_iters" in given:
            raise ConfigError(f"give --lr-warmup-fraction ({fraction}) or --lr-warmup-iters "
                              f"({given['lr_warmup_iters']}), not both")
        if not 0.0 <= fraction <= 1.0:
            raise ConfigError(f"lr_warmup_fraction={fraction} must be in [0, 1]")
        iters = given.get("train_iters", train_over.get("train_iters", TrainConfig.train_iters))
        given["lr_warmup_iters"] = int(fraction * iters)
    if "params_dtype" not in given and (given.get("bf16") or given.get("fp16")):   # as Megatron's --bf16 / --fp16
        given["params_dtype"] = "bfloat16" if given.get("bf16") else "float16"
    model_cfg = getattr(ModelConfig, style)(**{**model_over, **{k: v for k, v in given.items() if k in model_names}})
    train_cfg = TrainConfig(**{**train_over, **{k: v for k, v in given.items() if k not in model_names}})
    if cli["global_batch_size"] is not None:
        train_cfg = _apply_global_batch_size(train_cfg, cli["global_batch_size"], world_size,
                                             "grad_accum_steps" in given)
    minutes = cli["distributed_timeout_minutes"]
    if not 0 < minutes < math.inf:                      # nan fails both comparisons
        raise ConfigError(f"distributed_timeout_minutes={minutes} must be a positive, finite number of minutes")
    return model_cfg, train_cfg, cli


def _refuse_ignored_flags(given: dict[str, Any]) -> None:
    """ConfigError naming the flags when a flag given would do nothing without another one.

    TrainConfig.validate refuses the values it can see (a non-default --recompute-modules
    without selective recompute, --fp8-recipe tensorwise without --fp8-format); this sees what
    was typed, so the default values too: --recompute-modules core_attn, --fp8-recipe delayed.
    Refused, not warned about: a warning scrolls past, and the run would do less than its
    command line says."""
    def flag(name: str) -> str:
        return FLAGS[name][1][0]

    if "recompute_modules" in given and given.get("recompute_granularity") != "selective":
        raise ConfigError(f"{flag('recompute_modules')} {' '.join(given['recompute_modules'])} without "
                          f"--recompute-granularity selective: the modules are what selective recompute recomputes, "
                          f"and would be ignored")
    fp8 = [flag(n) for n in ("fp8_recipe", "fp8_margin", "fp8_amax_history_len", "fp8_amax_compute_algo") if n in given]
    if fp8 and given.get("fp8_format") is None:
        precision = "bf16" if given.get("bf16") else "fp16" if given.get("fp16") else "float32"
        raise ConfigError(f"{', '.join(fp8)} without --fp8-format: no FP8 at all, the run would train in {precision} "
                          f"(add --fp8-format hybrid or e4m3)")
    dynamic = [flag(n) for n in ("initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis") if n in given]
    if dynamic and (not given.get("fp16") or "loss_scale" in given):
        why = (f"with --loss-scale {given['loss_scale']:g} the scale is constant" if given.get("fp16") else
               "they set fp16's dynamic loss scale, and this run has none (--fp16 has one)")
        raise ConfigError(f"{', '.join(dynamic)}: {why}, so they would be ignored")


def _apply_global_batch_size(cfg: TrainConfig, global_batch: int, world_size: int, accum_given: bool) -> TrainConfig:
    """cfg with grad_accum_steps = global_batch / (micro_batch_size x dp), as Megatron derives
    its number of micro-batches; ConfigError when it does not divide."""
    tp, pp, b = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, cfg.micro_batch_size
    cp = cfg.context_parallel_size
    if tp < 1 or pp < 1 or cp < 1 or world_size % (tp * cp * pp):
        raise ConfigError(f"world size {world_size} is not divisible by tensor_model_parallel_size={tp} x "
                          f"context_parallel_size={cp} x pipeline_model_parallel_size={pp}, so there is no "
                          f"data-parallel size to split global_batch_size={global_batch} over")
    dp = world_size // (tp * cp * pp)
    if global_batch < 1 or b < 1 or global_batch % (b * dp):
        raise ConfigError(f"global_batch_size={global_batch} is not divisible by micro_batch_size={b} x data-parallel "
                          f"size {dp} (world size {world_size} / (tp {tp} x cp {cp} x pp {pp})): the micro-batches "
                          f"per step are global / (micro x dp)")
    m = global_batch // (b * dp)
    if accum_given and cfg.grad_accum_steps != m:
        raise ConfigError(f"global_batch_size={global_batch} means {m} micro-batches per step (global / "
                          f"(micro_batch_size={b} x dp {dp})), but grad_accum_steps={cfg.grad_accum_steps}: "
                          f"give one of the two")
    return dataclasses.replace(cfg, grad_accum_steps=m)


def configs_from_args(argv: Iterable[str] | None = None,
                      world_size: int | None = None) -> tuple[ModelConfig, TrainConfig]:
    """(model config, train config) from command-line flags (see parse_command_line)."""
    model_cfg, train_cfg, _ = parse_command_line(argv, world_size)
    return model_cfg, train_cfg
