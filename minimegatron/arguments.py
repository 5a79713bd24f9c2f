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
import re
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
# Each ModelConfig / TrainConfig field declares its flags, --help group and one-line help
# (config.opt); the default is appended from the configs themselves. The first name of a
# flag is Megatron's spelling (checked 2026-11-24 against Megatron-LM main: the flags
# megatron/training/arguments.py adds, and those it generates from TransformerConfig,
# TrainingConfig, SchedulerConfig, CheckpointConfig, RNGConfig); more names are the book's.
GROUPS = ("model", "moe", "training", "mixed precision", "parallelism", "data", "checkpointing", "logging")
FIELDS = {f.name: f for cls in (ModelConfig, TrainConfig) for f in dataclasses.fields(cls)}


def command_line(f: dataclasses.Field) -> tuple[tuple[str, ...], tuple[tuple[str, Any, str], ...]]:
    """(flags taking a value, switches) of a config field as config.opt declares it: its flags
    are by default its name (--hidden-size); a bool's are switches setting it True."""
    flags = f.metadata["flags"] or (f"--{f.name.replace('_', '-')}",)
    if not isinstance(f.default, bool):
        return flags, f.metadata["switches"]
    own = tuple((flag, True, f.metadata["help"]) for flag in flags) if f.metadata["help"] else ()
    return (), own + f.metadata["switches"]


# field -> (group, flag names, help), for the fields that take a value
FLAGS: dict[str, tuple[str, tuple[str, ...], str]] = {
    name: (f.metadata["group"], command_line(f)[0], f.metadata["help"]) for name, f in FIELDS.items()
    if command_line(f)[0]}

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


HINT = "(python -m minimegatron.train --help lists every flag)"


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors raised as ConfigError (main prints them and returns 2)."""

    def error(self, message: str):
        raise ConfigError(f"{message} {HINT}")


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
    def value(preset: str, style: str) -> Any:
        model, train_cfg = getattr(ModelConfig, style)(**PRESETS[preset][0]), TrainConfig(**PRESETS[preset][1])
        return getattr(model if hasattr(model, field_name) else train_cfg, field_name)
    base = value("tiny", "llama")
    others = [(f"--preset {p}", value(p, "llama")) for p in PRESETS] + [("--style gpt2", value("tiny", "gpt2"))]
    return f"[default: {_shown(base)}" + "".join(f"; {name}: {_shown(v)}" for name, v in others if v != base) + "]"


def _value_type(f: dataclasses.Field) -> dict[str, Any]:
    """argparse's type (and nargs) from the field's annotation: `int | None` -> int,
    `tuple[int, int]` -> 2 ints, `tuple[str, ...]` -> one or more strings."""
    kind = {"int": int, "float": float, "str": str}[re.search(r"\b(int|float|str)\b", str(f.type)).group(1)]
    if not str(f.type).startswith("tuple"):
        return dict(type=kind)
    return dict(type=kind, nargs="+" if "..." in str(f.type) else str(f.type).count(",") + 1)


def build_parser() -> argparse.ArgumentParser:
    """The parser of `python -m minimegatron.train`: every ModelConfig / TrainConfig field is a
    flag or switch in one of Megatron's groups, as its `config.opt` declares; CLI_ONLY adds the
    command-line-only ones; NOT_IN_BOOK refuses Megatron flags the book does not implement.
    Every value defaults to None ("not given") so that presets apply underneath."""
    parser = _Parser(prog="python -m minimegatron.train", description=__doc__.split("\n\n")[0],
                     usage="%(prog)s [--preset {tiny,demo}] [--style {llama,gpt2}] [FLAG VALUE | SWITCH ...]",
                     formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
                     epilog="Flags and switches are spelled as in Megatron-LM (checked 2026-11-24), except those "
                            "marked (the book's)\nand the second names --layernorm-epsilon, --save-dir, --load-dir. "
                            "A preset sets the sizes;\nany flag given overrides it.")
    groups = {title: parser.add_argument_group(title) for title in ("presets", *GROUPS)}
    groups["presets"].add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                                   help="model and run sizes that train in seconds (tiny) to minutes (demo); a "
                                        "preset's warm-up scales with --train-iters [default: tiny]")
    groups["presets"].add_argument("--style", choices=["llama", "gpt2"], default="llama",
                                   help="llama: RMSNorm, SwiGLU, RoPE, no biases, untied; gpt2: LayerNorm, GELU, "
                                        "learned positions, biases, tied [default: llama]")
    for f in FIELDS.values():
        if "group" not in f.metadata:
            raise RuntimeError(f"config field {f.name} has no command line: declare it with config.opt")
        (flags, switches), group = command_line(f), groups[f.metadata["group"]]
        if flags:
            group.add_argument(*flags, dest=f.name, default=None, metavar=f.name.upper(), **_value_type(f),
                               help=f"{f.metadata['help']} {_defaults(f.name)}".replace("%", "%%"))
        for switch, value, text in switches:
            shown = f" {_defaults(f.name)}" if not flags and value is True else ""
            group.add_argument(switch, dest=f.name, action="store_const", const=value, default=None,
                               help=(text + shown).replace("%", "%%"))
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
        other = [s for s, _, _ in command_line(FIELDS[action.dest])[1] if s != before] if action.dest in FIELDS else []
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
        raise ConfigError(f"{_explain_leftovers(extra, argv, parser)} {HINT}")
    args = vars(namespace)
    cli = {dest: args.pop(dest) for dest in (flag.lstrip("-").replace("-", "_") for flag in CLI_ONLY)}
    model_over, train_over = PRESETS[args.pop("preset")]
    train_over = dict(train_over)
    style = args.pop("style")
    model_names = {f.name for f in dataclasses.fields(ModelConfig)}
    given = {k: tuple(v) if isinstance(v, list) else v for k, v in args.items() if v is not None}   # nargs: lists
    _refuse_ignored_flags(given)
    if "train_iters" in given and "lr_warmup_iters" not in given and "lr_warmup_iters" in train_over:
        train_over["lr_warmup_iters"] = train_over["lr_warmup_iters"] * given["train_iters"] // train_over["train_iters"]
    if (fraction := cli["lr_warmup_fraction"]) is not None:
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
    """ConfigError naming the flags when one given would do nothing without another. Unlike
    TrainConfig.validate, this sees what was typed, default values included (--fp8-recipe
    delayed without --fp8-format); refused, not warned: the run would do less than it says."""
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
