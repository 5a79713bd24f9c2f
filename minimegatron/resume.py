"""Resuming a run: what must match the checkpoint, what may change, and what each rank loads.

    state, own, line = load_for_resume(model_cfg, cfg, layout)     # train.train, on every rank

A checkpoint (checkpoint.py) holds the model, the optimizer, the RNG states and the step; the
rest of the run is decided by the training config, so train.train resumes only with the same
values of RESUME_MUST_MATCH, by field and flag. train_iters and lr_warmup_iters may change:
a larger --train-iters extends a finished or interrupted run, with the learning-rate schedule
recomputed for the new length, and the line the resume prints says how the next
iteration's learning rate changed (check_resume_config).
"""

from __future__ import annotations

from .arguments import FLAGS
from .checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, load_rank_state
from .config import ModelConfig, TrainConfig, to_dict
from .optim import learning_rate
from .parallel_state import Layout

__all__ = ["RESUME_MUST_MATCH", "SCHEDULE_FIELDS", "LAYOUT_FIELDS", "check_resume_config", "check_reshard_config",
           "load_for_resume"]


# What decides the rest of a run besides the saved state: resuming with other values would
# silently break the "bit-identical to the uninterrupted run" guarantee, so it is refused.
# train_iters and lr_warmup_iters are not here: they may change (check_resume_config).
RESUME_MUST_MATCH = ("data_path", "tokenizer", "seq_length", "micro_batch_size", "grad_accum_steps",
                     "lr", "min_lr", "weight_decay", "adam_beta1",
                     "adam_beta2", "adam_eps", "clip_grad", "data_seed", "zero_stage",
                     "tensor_model_parallel_size", "pipeline_model_parallel_size", "pipeline_schedule",
                     "num_virtual_stages_per_pipeline_rank", "sequence_parallel", "context_parallel_size",
                     "cp_comm_type", "expert_model_parallel_size", "expert_tensor_parallel_size",
                     "moe_token_dispatcher_type")
SCHEDULE_FIELDS = ("train_iters", "lr_warmup_iters")
# What a torch_dist checkpoint (dist_checkpoint.py) may change on resume besides the schedule: the
# layout. The global batch must stay (micro_batch_size x grad_accum_steps x data-parallel size).
LAYOUT_FIELDS = ("zero_stage", "tensor_model_parallel_size", "pipeline_model_parallel_size", "pipeline_schedule",
                 "num_virtual_stages_per_pipeline_rank", "sequence_parallel", "context_parallel_size", "cp_comm_type",
                 "expert_model_parallel_size", "expert_tensor_parallel_size", "moe_token_dispatcher_type",
                 "micro_batch_size", "grad_accum_steps")


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


def load_for_resume(model_cfg: ModelConfig, cfg: TrainConfig, layout: Layout) -> tuple[dict, dict, str]:
    """(the checkpoint's main state, this rank's own state, the line to print) for resuming
    from cfg.load_dir's `latest`, on this rank; CheckpointError when it cannot be resumed:
    a file that is missing or unreadable, another model (every differing field), another
    layout (both layouts, counted as the banner counts them), another training config
    (check_resume_config). No collective: train makes the ranks agree afterwards."""
    path = latest_checkpoint(cfg.load_dir, warn=False)
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
    return state, own, line + (f"; {schedule}" if schedule else "")


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
