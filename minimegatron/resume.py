"""A run's checkpoints, both formats, through one path: save one, open one, restore from it.

    layout = initialize_layout(cfg)                                 # train.train and load_model
    checkpoint = open_checkpoint(model_cfg, cfg, layout)            # each rank apart; None: none to load
    chunks = build_model(..., load=checkpoint.model_states)         # the torch format's weights
    restore_state(checkpoint, chunks, optimizer, model_cfg, cfg, layout)   # optimizer, RNG; torch_dist: weights
    save_state(cfg, model_cfg, step, chunks, optimizer, layout, losses, eval_losses)
    model, model_cfg, tokenizer, layout = load_model(path, tp, pp)  # generate.py: a torch_dist model to decode

The formats: checkpoint.py's "torch" (rank 0's file with the single-device model, one file per
rank with its own chunks and optimizer; resumes only on the same layout) and dist_checkpoint.py's
"torch_dist" (pieces with global offsets; any layout resumes it, chapter 08). A checkpoint holds
the model, the optimizer, the RNG states and the step; the rest of the run is decided by the
training config, so a run resumes only with the same values of RESUME_MUST_MATCH (torch_dist:
the layout's fields may change, the global batch may not). train_iters and lr_warmup_iters may
change: a larger --train-iters extends a run, with the learning-rate schedule recomputed for the
new length, and the line the resume prints says how (check_resume_config). Megatron-LM:
megatron/training/checkpointing.py (save_checkpoint, load_checkpoint).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from . import parallel_state
from .arguments import FLAGS
from .checkpoint import (CheckpointError, all_ranks_agree, check_same_model, latest_checkpoint, load_checkpoint,
                         load_rank_state, save_checkpoint, save_rank_state)
from .comm import barrier
from .config import ModelConfig, TrainConfig, to_dict
from .cp.attention import hierarchical_sizes
from .dist_checkpoint import (MAY_CHANGE, find_distributed_checkpoint, is_distributed_checkpoint, layout_signature,
                              load_distributed, read_common, save_distributed)
from .dp import local_tensors, unwrap
from .fp8 import delayed_scaling_states, load_delayed_scaling_states
from .optim import Optimizer, learning_rate
from .parallel_state import Layout
from .parallelize import build_model, full_model_tensors
from .tp import get_rng_tracker

__all__ = ["RESUME_MUST_MATCH", "SCHEDULE_FIELDS", "LAYOUT_FIELDS", "check_resume_config", "check_reshard_config",
           "initialize_layout", "Checkpoint", "open_checkpoint", "restore_state", "save_state", "holds_part_of_model",
           "chunk_state", "load_model"]


# The layout's fields (a torch_dist checkpoint may change them on resume, LAYOUT_FIELDS)
_PARALLELISM = ("zero_stage", "tensor_model_parallel_size", "pipeline_model_parallel_size", "pipeline_schedule",
                "num_virtual_stages_per_pipeline_rank", "sequence_parallel", "context_parallel_size", "cp_comm_type",
                "expert_model_parallel_size", "expert_tensor_parallel_size", "moe_token_dispatcher_type")
# What decides the rest of a run besides the saved state: resuming with other values would
# silently break the "bit-identical to the uninterrupted run" guarantee, so it is refused.
# train_iters and lr_warmup_iters are not here: they may change (check_resume_config).
RESUME_MUST_MATCH = ("data_path", "tokenizer", "seq_length", "micro_batch_size", "grad_accum_steps", "lr", "min_lr",
                     "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad", "data_seed") + _PARALLELISM
SCHEDULE_FIELDS = ("train_iters", "lr_warmup_iters")
# What a torch_dist checkpoint (dist_checkpoint.py) may change on resume besides the schedule: the
# layout. The global batch must stay (micro_batch_size x grad_accum_steps x data-parallel size).
LAYOUT_FIELDS = _PARALLELISM + ("micro_batch_size", "grad_accum_steps")


def check_resume_config(saved: dict, cfg: TrainConfig, where: str, step: int) -> str | None:
    """Check this run's config against the checkpoint's (`saved`), resumed after `step`
    iterations; returns what changed in the learning-rate schedule, or None.

    CheckpointError naming every field of RESUME_MUST_MATCH that differs (with the flag that
    gives the checkpoint's value), or a train_iters below `step`. train_iters and
    lr_warmup_iters may differ, to extend a run (--train-iters 80 after 40): the schedule
    (warm-up, then the cosine to min_lr at train_iters, optim.learning_rate) is recomputed
    from this run's values, so the iterations after `step` take other learning rates than
    the checkpoint's run would have; the returned text says which. Megatron-LM does the same
    with --override-opt-param-scheduler; without it (its default) it refuses a scheduler
    whose decay length differs from the checkpoint's, unless --lr-decay-iters keeps it, and
    --use-checkpoint-opt-param-scheduler keeps the checkpoint's schedule instead."""
    now = to_dict(cfg)
    diffs = [k for k in RESUME_MUST_MATCH if k in saved and saved[k] != now[k]]
    if diffs:
        flags = " ".join(f"{FLAGS[k][1][0]} {saved[k]}" for k in diffs if k in FLAGS and saved[k] is not None)
        raise CheckpointError(f"cannot resume exactly from {where}: the training config differs: " +
                              "; ".join(f"{k}: checkpoint {saved[k]!r}, run {now[k]!r}" for k in diffs) +
                              (f" (to resume, give the checkpoint's values: {flags})" if flags else ""))
    if cfg.train_iters < step:
        raise CheckpointError(f"train_iters={cfg.train_iters} is below the {step} iterations the checkpoint in "
                              f"{where} has done: give --train-iters {step} or more")
    old = {k: saved.get(k, now[k]) for k in SCHEDULE_FIELDS}
    if all(old[k] == now[k] for k in SCHEDULE_FIELDS):
        return None
    before = TrainConfig(**{**now, **old})
    changed = " and ".join(f"{k}={now[k]} (checkpoint: {old[k]})" for k in SCHEDULE_FIELDS if old[k] != now[k])
    next_lr = (f"; iteration {step + 1} takes lr {learning_rate(step, cfg):.3g}, where the checkpoint's schedule "
               f"gave {learning_rate(step, before):.3g}" if step < cfg.train_iters else "")
    return (f"the learning-rate schedule is recomputed from this run's {changed}: warm-up over "
            f"{cfg.lr_warmup_iters} iterations, then the cosine to min_lr at iteration {cfg.train_iters}{next_lr} "
            f"(as Megatron-LM's --override-opt-param-scheduler)")


def check_reshard_config(common: dict, cfg: TrainConfig, layout: Layout, where: str) -> str | None:
    """check_resume_config for a torch_dist checkpoint (its `common` part), resumed under
    `layout`: the fields of LAYOUT_FIELDS may differ, but the global batch (micro_batch_size x
    grad_accum_steps x data-parallel size) must not, or the iterations after the checkpoint would
    see other data than the uninterrupted run; CheckpointError naming both. Returns what changed
    in the learning-rate schedule, or None."""
    saved = common.get("train_config", {})
    before = saved.get("micro_batch_size", 0) * saved.get("grad_accum_steps", 0) * common.get("data_parallel_size", 1)
    now = cfg.micro_batch_size * cfg.grad_accum_steps * layout.data_parallel_size
    if before != now:
        raise CheckpointError(f"cannot resume from {where}: its global batch is {before} sequences "
                              f"(micro_batch_size {saved.get('micro_batch_size')} x grad_accum_steps "
                              f"{saved.get('grad_accum_steps')} x data-parallel size {common.get('data_parallel_size', 1)}), "
                              f"this run's {now} ({cfg.micro_batch_size} x {cfg.grad_accum_steps} x "
                              f"{layout.data_parallel_size}): keep the product, e.g. --global-batch-size {before}")
    kept = {k: v for k, v in saved.items() if k not in LAYOUT_FIELDS}
    return check_resume_config(kept, cfg, where, common["step"])


# ---------------------------------------------------------------------------------------
# the layout a checkpoint is loaded into
# ---------------------------------------------------------------------------------------
def initialize_layout(cfg: TrainConfig) -> Layout:
    """This process's Layout: Layout() on one process; in a world of n ranks (torchrun or
    launch.spawn) the process groups of tensor_model_parallel_size x context_parallel_size x
    pipeline_model_parallel_size (and the hierarchical cp groups of "a2a+p2p"), the rest data
    parallel (validate_layout first)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return Layout()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()            # maybe another layout in the same world
    cp = cfg.context_parallel_size
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.pipeline_model_parallel_size, context_parallel_size=cp,
        expert_model_parallel_size=cfg.expert_model_parallel_size, expert_tensor_parallel_size=cfg.etp,
        hierarchical_context_parallel_sizes=hierarchical_sizes(cp, cfg.cp_comm_type,
                                                               cfg.hierarchical_context_parallel_sizes))
    return parallel_state.get_layout()


def holds_part_of_model(layout: Layout) -> bool:
    """Does each rank hold only a part of the model (tp, pp, ep or etp > 1)? Then each saves its
    own chunks' state dicts, which a resume with the same layout loads."""
    return layout.tp > 1 or layout.pp > 1 or layout.ep > 1 or layout.etp > 1


# ---------------------------------------------------------------------------------------
# save
# ---------------------------------------------------------------------------------------
def save_state(cfg: TrainConfig, model_cfg: ModelConfig, step: int, chunks: list[nn.Module], optimizer: Optimizer,
               layout: Layout, losses: list[float], eval_losses: list[tuple[int, float]]) -> str:
    """Save iteration `step` in cfg.ckpt_format; returns the checkpoint's path. Collective.

    torch_dist: dist_checkpoint.save_distributed. torch (checkpoint.py): every rank's own file
    first, then rank 0's main file, whose "model" is always the single-device state (the shards
    gathered: full_model_tensors). When the model is split (holds_part_of_model) each rank's own
    file also holds its chunks' state dicts (chunk_state), which a resume on the same layout loads."""
    history = {"losses": losses, "eval_losses": [list(x) for x in eval_losses]}
    rng = {"rng": torch.get_rng_state(), "tp_rng": get_rng_tracker().get_states()}
    if cfg.ckpt_format == "torch_dist":
        common = {"model_config": to_dict(model_cfg), "train_config": to_dict(cfg),
                  "data_parallel_size": layout.data_parallel_size, "history": history}
        return str(save_distributed(cfg.save_dir, step, chunks, optimizer, layout, common, rng))
    model_state = full_model_tensors(chunks, layout)                      # collective
    own = {"optimizer": optimizer.state_dict(), **rng,
           "fp8": {name: state for c in chunks for name, state in delayed_scaling_states(c).items()}}
    if holds_part_of_model(layout):
        own["model"] = [chunk_state(c) for c in chunks]
    if layout.world > 1:
        save_rank_state(cfg.save_dir, step, layout.rank, own)
        barrier(None, tag="checkpoint")                           # all rank files exist
    path = Path(cfg.save_dir) / f"iter_{step:07d}.pt"
    if layout.rank == 0:
        main = {"model_config": to_dict(model_cfg), "train_config": to_dict(cfg), "model": model_state,
                "dp_size": layout.dp, "tp_size": layout.tp, "pp_size": layout.pp, "cp_size": layout.cp,
                "history": history}
        path = save_checkpoint(cfg.save_dir, step, main | (own if layout.world == 1 else {}))
    if layout.world > 1:
        barrier(None, tag="checkpoint")                           # nobody runs ahead of `latest`
    return str(path)


def chunk_state(chunk: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of this rank's GPTModel chunk, as build_model loads it: its parameters as
    this rank holds them (dp.local_tensors: ZeRO-3's gathered over dp, a collective) and its
    saved buffers."""
    model = unwrap(chunk)
    params = dict(model.named_parameters())                  # (none left under ZeRO-3)
    state = {n: t.detach().clone() for n, (_, t) in local_tensors(chunk).items()}
    return state | {n: t for n, t in model.state_dict().items() if n not in params}


# ---------------------------------------------------------------------------------------
# open, then restore
# ---------------------------------------------------------------------------------------
@dataclass
class Checkpoint:
    """The checkpoint a run resumes, as open_checkpoint read it on this rank, before the model exists."""
    path: Path
    line: str                                  # what rank 0 prints
    step: int = 0                              # the iteration the run continues from (0: --finetune)
    losses: list[float] = field(default_factory=list)                 # the history before `step`
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    model_states: list[dict] | None = None     # torch: the chunks' state dicts build_model loads
    own: dict | None = None                    # torch: this rank's optimizer, RNG and FP8 states
    distributed: bool = False                  # torch_dist: restore_state loads the weights too
    finetune: bool = False                     # torch_dist: the weights only (--finetune, a release)


def open_checkpoint(model_cfg: ModelConfig, cfg: TrainConfig, layout: Layout) -> Checkpoint | None:
    """The newest checkpoint of cfg.load_dir (None when it holds none: a warning, training starts
    from scratch), read on this rank, after checking that this run may resume it: CheckpointError
    naming a missing or damaged file, another model (every differing field), another layout (the
    torch format), another training config (check_resume_config, check_reshard_config). No
    collective: train makes the ranks agree afterwards (checkpoint.all_ranks_agree)."""
    path = latest_checkpoint(cfg.load_dir)
    if path is None:
        return None
    if is_distributed_checkpoint(path):                              # any layout (chapter 08)
        return _open_distributed(path, model_cfg, cfg, layout)
    if cfg.finetune or cfg.no_load_optim or cfg.no_load_rng:
        raise CheckpointError(f"{path} is a ckpt-format torch checkpoint: --finetune, --no-load-optim and "
                              f"--no-load-rng need a torch_dist one")
    return _open_torch(path, model_cfg, cfg, layout)


def _open_torch(path: Path, model_cfg: ModelConfig, cfg: TrainConfig, layout: Layout) -> Checkpoint:
    """open_checkpoint of checkpoint.py's format: the same layout only (counted as the banner counts it)."""
    state = load_checkpoint(path, model_config=to_dict(model_cfg))
    tp, pp, cp = state.get("tp_size", 1), state.get("pp_size", 1), state.get("cp_size", 1)
    dp = state.get("dp_size", 1) // cp                   # saved: the "dp-cp" size (replicas x cp)
    if (tp, pp, cp, dp) != (layout.tp, layout.pp, layout.cp, layout.data_parallel_size):
        def shown(tp, cp, pp, dp):
            n = tp * cp * pp * dp
            return f"{n} rank{'s' * (n > 1)}: tp_size={tp} x cp_size={cp} x pp_size={pp} x data-parallel size {dp}"
        raise CheckpointError(f"checkpoint in {cfg.load_dir} was written by {shown(tp, cp, pp, dp)}; this run has "
                              f"{shown(layout.tp, layout.cp, layout.pp, layout.data_parallel_size)} (the "
                              f"data-parallel size counts model replicas, context-parallel ranks excluded, as "
                              f"Megatron-LM's dp and this program's banner)")
    step = state["step"]
    schedule = check_resume_config(state.get("train_config", {}), cfg, cfg.load_dir, step)
    own = state if layout.world == 1 else load_rank_state(cfg.load_dir, step, layout.rank)
    saved_iters = state.get("train_config", {}).get("train_iters", cfg.train_iters)
    line = (f"resumed from {path}: {step} of the checkpoint's {saved_iters} iterations done; " +
            (f"training iterations {step + 1} to {cfg.train_iters}" if step < cfg.train_iters else "nothing left to train"))
    return Checkpoint(path, line + (f"; {schedule}" if schedule else ""), step, list(state["history"]["losses"]),
                      [tuple(x) for x in state["history"]["eval_losses"]],
                      model_states=own["model"] if holds_part_of_model(layout) else [state["model"]], own=own)


def _open_distributed(path: Path, model_cfg: ModelConfig, cfg: TrainConfig, layout: Layout) -> Checkpoint:
    """open_checkpoint of dist_checkpoint.py's format: any layout (check_reshard_config; a
    --finetune run, or a release, only needs the same model and starts from iteration 0)."""
    common = read_common(path)
    check_same_model(common.get("model_config", {}), to_dict(model_cfg), path, MAY_CHANGE)
    if cfg.finetune or common.get("release"):
        what = "the released model" if common.get("release") else f"the model of iteration {common['step']}"
        return Checkpoint(path, f"loaded {what} of {path} to train from iteration 0 (--finetune)", distributed=True,
                          finetune=True)
    schedule = check_reshard_config(common, cfg, layout, cfg.load_dir)
    saved = common.get("layout", {})
    moved = "" if saved == layout_signature(layout) else (
        f"; resharded from {saved.get('world')} ranks (tp {saved.get('tp')}, pp {saved.get('pp')}, cp {saved.get('cp')}, "
        f"ep {saved.get('ep')}, dp-cp {saved.get('dp')}, ZeRO {common['train_config'].get('zero_stage')}) to "
        f"{layout.world} (tp {layout.tp}, pp {layout.pp}, cp {layout.cp}, ep {layout.ep}, dp-cp {layout.dp}, "
        f"ZeRO {cfg.zero_stage}); random states seeded afresh")
    line = f"resumed from {path}: {common['step']} iterations done{moved}" + (f"; {schedule}" if schedule else "")
    return Checkpoint(path, line, common["step"], list(common["history"]["losses"]),
                      [tuple(x) for x in common["history"]["eval_losses"]], distributed=True)


def restore_state(checkpoint: Checkpoint, chunks: list[nn.Module], optimizer: Optimizer, model_cfg: ModelConfig,
                  cfg: TrainConfig, layout: Layout) -> None:
    """Load the optimizer's state, FP8's scaling histories and the RNG states of `checkpoint`
    into the built model (torch_dist: its weights too, each rank reading the pieces it needs;
    --no-load-optim, --no-load-rng and --finetune leave out what they name). Every rank, apart;
    then all agree (a rank file of another layout fails here): CheckpointError on every rank."""
    error = None
    try:
        rng = None
        if checkpoint.distributed:
            loaded = load_distributed(str(checkpoint.path), chunks, optimizer, layout, model_config=to_dict(model_cfg),
                                      optimizer_state=not (cfg.no_load_optim or checkpoint.finetune))
            if not (cfg.no_load_rng or checkpoint.finetune):
                rng = loaded.get("own")
        else:
            optimizer.load_state_dict(checkpoint.own["optimizer"])
            for chunk in chunks:                # FP8 delayed scaling (none in a checkpoint from before it)
                load_delayed_scaling_states(chunk, checkpoint.own.get("fp8", {}))
            rng = checkpoint.own
        if rng is not None:
            torch.set_rng_state(rng["rng"])
            get_rng_tracker().set_states(rng["tp_rng"])
    except Exception as exc:                    # noqa: BLE001 - whatever it is, every rank must hear of it
        error = exc
    all_ranks_agree(error, "loading the checkpoint's tensors" if checkpoint.distributed
                    else "restoring the checkpoint's optimizer and random state")


# ---------------------------------------------------------------------------------------
# a checkpoint's model, for decoding (generate.py)
# ---------------------------------------------------------------------------------------
def load_model(load: str, tensor_parallel: int = 1,
               pipeline_parallel: int = 1) -> tuple[nn.Module, ModelConfig, str, Layout]:
    """(model on this rank, its config, the tokenizer spec, the layout) from the torch_dist
    checkpoint `load` (any layout saved it), cut over `tensor_parallel` x `pipeline_parallel`
    ranks (each data-parallel replica of the world generates the same tokens). Collective
    when the world has more than one rank (the layout's groups)."""
    path = find_distributed_checkpoint(load, "python -m minimegatron.convert --from-hf DIR --save CKPT")
    common = read_common(path)
    model_cfg = ModelConfig(**common["model_config"]).validate()
    cfg = TrainConfig(tensor_model_parallel_size=tensor_parallel, pipeline_model_parallel_size=pipeline_parallel,
                      seq_length=model_cfg.max_position_embeddings, micro_batch_size=1, progress=False,
                      eval_interval=0)
    layout = initialize_layout(cfg)
    model = build_model(model_cfg, cfg, layout)[0]
    load_distributed(path, [model], None, layout, model_config=common["model_config"])
    return model, model_cfg, common.get("train_config", {}).get("tokenizer", "byte"), layout
