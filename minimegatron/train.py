"""The training loop: one step and one loop that every chapter's parallelism plugs into.

    python -m minimegatron.train --help                            # the flags (arguments.py)
    python -m minimegatron.train --preset demo                     # the embedded corpus
    python -m minimegatron.train --preset tiny --train-iters 50 --hidden-size 32
    python -m minimegatron.train --data-path build/mydata/corpus --tokenizer tok.json ...
    python -m minimegatron.train --preset tiny --save runs/ckpt --save-interval 10
    python -m minimegatron.train --preset tiny --load runs/ckpt       # exact resume
    python -m minimegatron.train --preset tiny --load runs/ckpt --save runs/ckpt --train-iters 80   # extend it
    python -m minimegatron.train --help                               # every flag, by group
    torchrun --standalone --nproc_per_node=2 -m minimegatron.train --zero-stage 1   # chapter 01
    torchrun --standalone --nproc_per_node=4 -m minimegatron.train --tensor-model-parallel-size 2  # 02
    torchrun --standalone --nproc_per_node=8 -m minimegatron.train --tensor-model-parallel-size 2 \
        --pipeline-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 8   # 03: 3D, dp 2, 4 micro-batches
    torchrun --standalone --nproc_per_node=16 -m minimegatron.train --preset demo --num-layers 4 \
        --tensor-model-parallel-size 2 --sequence-parallel --context-parallel-size 2 \
        --num-experts 8 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2 --expert-model-parallel-size 2 \
        --pipeline-model-parallel-size 2 --micro-batch-size 1 --grad-accum-steps 4   # 05: 5D GPT-MoE (make demo)

The flags are Megatron-LM's where the book implements what they do (--global-batch-size with
--micro-batch-size, switches such as --untie-embeddings-and-output-weights, --disable-bias-linear,
--swiglu); Megatron flags for what the book does not implement are refused, saying which chapter
adds them.

One step (`train_step`, Megatron's train_step), the same code on every layout:

    forward and backward of the M micro-batches     pp > 1: the pipeline schedule
                                                    else: accumulate, DP sync on the last one
    finalize_model_grads                            the gradient hooks the transformations
                                                    registered (model/finalize.py)
    set the learning rate (warm-up, cosine); optimizer.step(): clip the global gradient
    norm, AdamW (optim.py)

The data order, the learning rate and the dropout RNG are functions of the step number and
of state saved in the checkpoint, so a run resumed at step k repeats the uninterrupted run's
losses bit for bit. A larger --train-iters extends a run instead: the learning-rate schedule
is then recomputed for the new length, and the resume says so (resume.py).

What stops a run, on every rank together, named once (main): a configuration that cannot
run, a checkpoint that cannot be resumed (a missing, truncated or damaged file of any rank:
its checksums; the ranks agree on the load first), a save directory that cannot be written
or that another run is writing (its lock names the owner), a loss or gradient norm that is
not finite (naming the iteration; with fp16's loss scaler too), parameters that are not
finite when a checkpoint is due, a loss scale that cannot go lower and overflows on every
step of a window (check_skipped_steps), a collective that times out (naming the ranks that
did not arrive, from their heartbeats: watchdog.py). Killing torchrun kills its ranks, from
their first line (lifeline.py).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn

from . import parallel_state
from .checkpoint import (CheckpointError, all_ranks_agree, check_save_dir, latest_checkpoint, lock_save_dir,
                         save_checkpoint, save_rank_state)
from .comm import all_reduce, barrier, record_communication
from .config import ConfigError, ModelConfig, TrainConfig, to_dict
from .dist_checkpoint import (FORMAT as DIST_FORMAT, MAY_CHANGE, is_distributed_checkpoint, layout_signature, load_distributed,
                              read_common, save_distributed)
from .data import (DataError, GPTDataset, IndexedDataset, batch_for_step, build_default_corpus, build_tokenizer,
                   train_valid_split)
from .dp import local_tensors, no_sync, storage_bytes
from .arguments import parse_command_line
from .launch import finish_torchrun, init_from_torchrun, print_once
from .model import finalize_model_grads, mean_loss
from .profiling import StepProfiler
from .model.moe import set_moe_aux_loss_scale
from .optim import Optimizer, is_expert_parameter, learning_rate, set_learning_rate
from .parallel_state import Layout
from .parallelize import build_model, build_optimizer, full_model_tensors, layout_device, unwrap, validate_layout
from .fp8 import delayed_scaling_states, load_delayed_scaling_states
from .grad_scaler import ConstantGradScaler, DynamicGradScaler
from .cp import get_batch_on_this_cp_rank
from .cp.attention import hierarchical_sizes
from .pp import PipelineComm, evaluate_pipelining, forward_backward_pipelining
from .pp.timeline import StepRecord
from .resume import (RESUME_MUST_MATCH, check_resume_config, check_reshard_config,  # noqa: F401 (they lived here)
                     load_for_resume)
from .tp import get_rng_tracker, model_parallel_manual_seed
from .watchdog import CollectiveTimeoutError, is_collective_timeout, missing_ranks_report, set_doing

# ---------------------------------------------------------------------------------------
# one step
# ---------------------------------------------------------------------------------------
def forward_backward_no_pipelining(model: nn.Module, microbatches: list[dict[str, torch.Tensor]],
                                   loss_scale: float = 1.0, record: StepRecord | None = None) -> float:
    """Accumulate gradients over micro-batches; returns the mean loss of the global batch.

    Each micro-batch's mean token loss is divided by the number of micro-batches, so the
    accumulated gradient equals the gradient of the mean loss over the whole batch (all
    micro-batches have the same number of tokens). Under data parallelism every micro-batch
    but the last runs under no_sync(): no communication while accumulating. The backward
    starts from the loss times `loss_scale` (the optimizer's loss scaler; 1 without one).
    `record`, if given, measures what each micro-batch's forward saves for its backward (one
    micro-batch is alive at a time: its backward runs before the next forward).
    """
    total = 0.0
    for i, mb in enumerate(microbatches):
        with no_sync(model) if i < len(microbatches) - 1 else nullcontext():
            with record.saving(i, 0) if record is not None else nullcontext():
                losses = model(mb["tokens"], position_ids=mb.get("position_ids"), labels=mb["labels"],
                               document_ids=mb.get("document_ids"))                                     # [b, s]
            if record is not None:
                record.in_flight([(i, 0)])
            loss = mean_loss(losses, mb.get("loss_mask"), mb.get("loss_tokens")) / len(microbatches)      # []
            (loss * loss_scale).backward()
        total += loss.item()
    return total


def train_step(chunks: list[nn.Module], optimizer: Optimizer, microbatches: list[dict[str, torch.Tensor]],
               layout: Layout, lr: float, p2p: PipelineComm | None = None, schedule: str = "1f1b",
               on_grads=None, forward_backward=None, pipeline_records: list | None = None
               ) -> tuple[float, float | None]:
    """One optimizer step over the global batch's micro-batches (this rank's share of them),
    Megatron's train_step, the same code on every layout:

        forward and backward of the micro-batches    pp > 1: the pipeline schedule
                                                      else: accumulate, DP sync on the last one
        model.finalize_model_grads                   every gradient hook the chunks registered
        optimizer.step()                             (loss scale,) clip, AdamW, copy back
        optimizer.zero_grad()

    Returns (the mean loss of this data-parallel rank's micro-batches, the global gradient
    norm before clipping, or None if the loss scaler skipped the step). `p2p` and `schedule`
    for a pipeline (layout.pp > 1). `on_grads()`, if given, runs once the gradients are final
    and before the optimizer reads them (tests and demos look at them there).
    `forward_backward(chunks, microbatches) -> loss`, if given, replaces the forward and
    backward (a chapter demo that writes them out, e.g. to record each micro-batch).
    `pipeline_records`, if given, receives the step's pp.timeline.StepRecord (without a pipeline:
    only the activation bytes each micro-batch saved)."""
    scale = optimizer.loss_scale
    set_moe_aux_loss_scale(chunks, scale / len(microbatches))   # MoE: aux losses weigh as the LM loss
    if forward_backward is not None:
        loss = forward_backward(chunks, microbatches)
    elif layout.pp > 1:
        loss, record = forward_backward_pipelining(chunks, microbatches, p2p, schedule, layout.pp_group, scale)
        if pipeline_records is not None:
            pipeline_records.append(record)
    else:
        record = None
        if pipeline_records is not None:
            record = StepRecord(layout.rank, params={p.untyped_storage().data_ptr() for p in chunks[0].parameters()})
            pipeline_records.append(record)
        loss = forward_backward_no_pipelining(chunks[0], microbatches, scale, record)
    finalize_model_grads(chunks)
    if on_grads is not None:
        on_grads()
    set_learning_rate(optimizer, lr)
    grad_norm = optimizer.step()
    optimizer.zero_grad()
    return loss, grad_norm


@torch.no_grad()
def evaluate(chunks: list[nn.Module], dataset: GPTDataset, cfg: TrainConfig, layout: Layout,
             p2p: PipelineComm | None = None, device: torch.device | str = "cpu") -> float:
    """Mean loss over the first eval_iters global batches (micro_batch_size * dp sequences
    each) of the validation set; each data-parallel rank evaluates its slice (each context-
    parallel rank its tokens of it)."""
    losses = []
    for i in range(cfg.eval_iters):
        mb = local_microbatch(dataset, i, cfg.micro_batch_size, 0, 1, layout, device)
        if layout.pp > 1:
            losses.append(evaluate_pipelining(chunks, mb, p2p, layout.pp_group, i))
        else:
            chunks[0].eval()
            losses.append(mean_loss(chunks[0](mb["tokens"], position_ids=mb["position_ids"], labels=mb["labels"],
                                              document_ids=mb.get("document_ids")), mb.get("loss_mask"),
                                    mb.get("loss_tokens")).item())
            chunks[0].train()
    mean = torch.tensor([sum(losses) / max(1, len(losses))], dtype=torch.float64, device=device)
    all_reduce(mean, layout.dp_group, op="avg", tag="loss")
    return mean.item()


def local_microbatch(dataset: GPTDataset, step: int, micro_batch_size: int, index: int, num_microbatches: int,
                     layout: Layout, device) -> dict[str, torch.Tensor]:
    """Micro-batch `index` of `step` as this rank sees it: its data-parallel replica's
    sequences (data_parallel_rank of data_parallel_size), then its context-parallel rank's
    tokens of them with their positions (cp/layout.get_batch_on_this_cp_rank):
    {"tokens", "labels": [b, s/cp], "position_ids": [s/cp]}."""
    batch = batch_for_step(dataset, step, micro_batch_size, index, num_microbatches,
                           layout.data_parallel_rank, layout.data_parallel_size)
    return {k: v.to(device) for k, v in get_batch_on_this_cp_rank(batch, layout.cp, layout.cp_rank).items()}


# ---------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------
@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)               # one per step, from step 0
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    out_dir: str = ""
    checkpoint: str | None = None
    last_step_communication: list = field(default_factory=list)    # comm records of the last step
    seconds: float = 0.0                                            # the loop's wall clock (machine-dependent)
    local_parameters: dict = field(default_factory=dict)           # {"dense", "experts"}: elements this rank holds
    held_bytes: dict = field(default_factory=dict)                 # held_state_bytes after the last step
    pipeline_records: list = field(default_factory=list)           # the last step's pp.timeline.StepRecord
    skipped_steps: int = 0                                          # steps the loss scaler skipped in this run


def build_datasets(model_cfg: ModelConfig, cfg: TrainConfig) -> tuple[GPTDataset, GPTDataset]:
    """Train and validation datasets; checks the tokenizer fits the model's vocabulary."""
    tokenizer = build_tokenizer(cfg.tokenizer)
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise ConfigError(f"tokenizer {cfg.tokenizer!r} has vocab_size={tokenizer.vocab_size} > "
                          f"model vocab_size={model_cfg.vocab_size}")
    prefix = cfg.data_path or build_default_corpus()
    indexed = IndexedDataset(prefix, vocab_size=model_cfg.vocab_size)   # every id has an embedding row
    train_docs, valid_docs = train_valid_split(indexed, valid_fraction=0.1)
    masks = dict(eod=tokenizer.eod, reset_position_ids=cfg.reset_position_ids,
                 reset_attention_mask=cfg.reset_attention_mask, eod_mask_loss=cfg.eod_mask_loss)
    train = GPTDataset(indexed, cfg.seq_length, seed=cfg.data_seed, split=train_docs, **masks)
    valid = GPTDataset(indexed, cfg.seq_length, seed=cfg.data_seed, split=valid_docs, **masks)
    return train, valid


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


def train(model_cfg: ModelConfig, cfg: TrainConfig) -> TrainResult:
    """Train from scratch or resume from cfg.load_dir; returns the loss history.

    On one process this is the baseline. Under torchrun (or `launch.spawn`) with n ranks the
    ranks form a tp x cp x dp x pp grid (Megatron's order, tp fastest): every matrix split over tp
    ranks (chapter 02, with sequence parallelism if asked: chapter 04), every sequence over cp
    ranks (chapter 04), the layers cut into pp stages running cfg.pipeline_schedule over the
    grad_accum_steps micro-batches (chapter 03), and dp = n / (tp cp pp) data-parallel replicas,
    each taking its slice of every global batch of micro_batch_size x grad_accum_steps x dp
    sequences, synced as cfg.zero_stage / cfg.ddp_impl ask (chapter 01). A GPT-MoE's experts are
    laid over the same ranks on their own grid, etp x ep x expert-dp x pp (chapter 05).

    Resuming: every rank reads the checkpoint's main file and its own (load_for_resume), then
    all ranks agree on the outcome in one collective (checkpoint.all_ranks_agree), so a
    truncated or missing file of one rank ends every rank at once with a CheckpointError
    naming it. Rank 0 prints which iteration was loaded (and how the schedule changed when
    train_iters did: check_resume_config). Saving: rank 0 holds cfg.save_dir's lock for the
    whole run (checkpoint.lock_save_dir; another run writing it is refused, by owner).
    Failures, on every rank together: a non-finite loss or gradient norm raises
    NonFiniteError naming the iteration (check_finite_step); a collective that times out
    raises watchdog.CollectiveTimeoutError naming the ranks that did not arrive.
    """
    validate_layout(model_cfg, cfg, dist.get_world_size() if dist.is_initialized() else 1)
    layout = initialize_layout(cfg)
    try:
        return _train(model_cfg, cfg, layout)
    except RuntimeError as exc:
        if layout.world > 1 and is_collective_timeout(exc) and not isinstance(exc, CollectiveTimeoutError):
            raise CollectiveTimeoutError(missing_ranks_report(exc)) from exc
        raise


def _train(model_cfg: ModelConfig, cfg: TrainConfig, layout: Layout) -> TrainResult:
    """train's body, once the layout's groups exist."""
    train_ds, valid_ds = build_datasets(model_cfg, cfg)
    split = holds_part_of_model(layout)
    lock = state = own = None
    try:
        error = None
        try:                                   # every rank, apart: its own file; then all agree
            if cfg.save_dir and layout.rank == 0:
                lock = lock_save_dir(cfg.save_dir)
            path = latest_checkpoint(cfg.load_dir) if cfg.load_dir else None
            if path is not None and is_distributed_checkpoint(path):     # any layout (chapter 08)
                state, loaded = _check_distributed(path, model_cfg, cfg, layout)
            elif path is not None:
                if cfg.finetune or cfg.no_load_optim or cfg.no_load_rng:
                    raise CheckpointError(f"{path} is a ckpt-format torch checkpoint: --finetune, --no-load-optim and "
                                          f"--no-load-rng need a torch_dist one")
                state, own, loaded = load_for_resume(model_cfg, cfg, layout)
        except Exception as exc:               # noqa: BLE001 - whatever it is, every rank must hear of it
            error = exc
        if cfg.save_dir or cfg.load_dir:       # the same on every rank: all call it, or none
            all_ranks_agree(error, " and ".join(["taking the lock of save_dir"] * bool(cfg.save_dir) +
                                                ["loading the checkpoint"] * bool(cfg.load_dir)))
        if layout.rank == 0 and lock is not None and lock.previous:
            print(f"note: took over the lock of {cfg.save_dir}, left by a run that ended without releasing it "
                  f"(pid {lock.previous.get('pid')}, started {lock.previous.get('started')})")
        if layout.rank == 0 and state is not None:
            print(loaded)
        return _run(model_cfg, cfg, layout, train_ds, valid_ds, split, state, own)
    finally:
        if lock is not None:
            lock.release()


def _check_distributed(path: Path, model_cfg: ModelConfig, cfg: TrainConfig, layout: Layout) -> tuple[dict, str]:
    """(the common part of the torch_dist checkpoint `path`, the line to print), after checking
    that this run may resume it under its layout (resume.check_reshard_config; a --finetune
    run only needs the same model, which loading checks)."""
    common = dict(read_common(path), path=str(path))
    stored = common.get("model_config", {})
    diffs = [f"{k}: checkpoint {stored.get(k)!r}, run {v!r}" for k, v in to_dict(model_cfg).items()
             if stored.get(k) != v and k not in MAY_CHANGE]
    if diffs:
        raise CheckpointError(f"checkpoint {path} is from another model: " + "; ".join(diffs))
    if cfg.finetune or common.get("release"):
        what = "the released model" if common.get("release") else f"the model of iteration {common['step']}"
        return common, f"loaded {what} of {path} to train from iteration 0 (--finetune)"
    schedule = check_reshard_config(common, cfg, layout, cfg.load_dir)
    saved = common.get("layout", {})
    moved = "" if saved == layout_signature(layout) else (
        f"; resharded from {saved.get('world')} ranks (tp {saved.get('tp')}, pp {saved.get('pp')}, cp {saved.get('cp')}, "
        f"ep {saved.get('ep')}, dp-cp {saved.get('dp')}, ZeRO {common['train_config'].get('zero_stage')}) to "
        f"{layout.world} (tp {layout.tp}, pp {layout.pp}, cp {layout.cp}, ep {layout.ep}, dp-cp {layout.dp}, "
        f"ZeRO {cfg.zero_stage}); random states seeded afresh")
    line = f"resumed from {path}: {common['step']} iterations done{moved}"
    return common, line + (f"; {schedule}" if schedule else "")


def _run(model_cfg, cfg, layout, train_ds, valid_ds, split, state, own) -> TrainResult:
    """Build the model and the optimizer (from the checkpoint's state, if any), then the loop."""
    distributed = state is not None and state.get("format") == DIST_FORMAT
    chunks = build_model(model_cfg, cfg, layout,
                         load=None if state is None or distributed else own["model"] if split else [state["model"]])
    # dropout masks, seeded after the model is built (building may draw from the default
    # generator, and must not shift the masks): a stream shared by the TP group for the
    # replicated activations and one per TP rank for the split ones (tp/random.py); each
    # pipeline stage its own (Megatron adds 100 x pp_rank)
    model_parallel_manual_seed(cfg.data_seed, tp_rank=layout.tp_rank, pp_rank=layout.pp_rank)
    optimizer = build_optimizer(chunks, cfg, layout)
    device = layout_device(cfg)
    # what travels between stages: this rank's tokens, [b, s/cp, h], and [b, s/(cp tp), h] under SP
    local_seq = cfg.seq_length // layout.cp // (layout.tp if cfg.sequence_parallel else 1)
    p2p = (PipelineComm(layout.pp_ranks, layout.pp_rank, len(chunks), (cfg.micro_batch_size, local_seq,
                                                                      model_cfg.hidden_size), model_cfg.dtype, device,
                        overlap_p2p_comm=cfg.overlap_p2p_comm)
           if layout.pp > 1 else None)
    result = TrainResult(out_dir=cfg.out_dir, local_parameters=local_parameter_counts(chunks))

    start = 0
    if distributed:
        error = None
        try:                                    # each rank reads the pieces it needs, apart
            finetune = cfg.finetune or bool(state.get("release"))      # a release loads as --finetune
            common = load_distributed(state["path"], chunks, optimizer, layout, model_config=to_dict(model_cfg),
                                      optimizer_state=not (cfg.no_load_optim or finetune))
            if "own" in common and not (cfg.no_load_rng or finetune):
                torch.set_rng_state(common["own"]["rng"])
                get_rng_tracker().set_states(common["own"]["tp_rng"])
        except Exception as exc:                # noqa: BLE001
            error = exc
        all_ranks_agree(error, "loading the checkpoint's tensors")
        if not (cfg.finetune or state.get("release")):
            start = state["step"]
            result.losses = list(state["history"]["losses"])
            result.eval_losses = [tuple(x) for x in state["history"]["eval_losses"]]
    elif state is not None:
        error = None
        try:                                    # a rank file of another layout fails here, apart
            optimizer.load_state_dict(own["optimizer"])
            for chunk in chunks:                # FP8 delayed scaling (none in a checkpoint from before it)
                load_delayed_scaling_states(chunk, own.get("fp8", {}))
            torch.set_rng_state(own["rng"])
            get_rng_tracker().set_states(own["tp_rng"])
        except Exception as exc:                # noqa: BLE001
            error = exc
        all_ranks_agree(error, "restoring the checkpoint's optimizer and random state")
        start = state["step"]
        result.losses = list(state["history"]["losses"])
        result.eval_losses = [tuple(x) for x in state["history"]["eval_losses"]]

    if start >= cfg.train_iters and layout.rank == 0:      # a resume with nothing left to do says so
        print(f"resumed at iteration {start}, and --train-iters is {cfg.train_iters}: nothing left to train"
              + (f", nothing saved to {cfg.save_dir}" if cfg.save_dir else "")
              + f" (a --train-iters above {start} continues the run)")
    progress = _progress_bar(start, cfg) if layout.rank == 0 else None
    skipped_in_a_row = 0                         # skipped steps at a loss scale that cannot go lower
    started = time.perf_counter()
    with StepProfiler(cfg, layout.rank, cfg.out_dir) as profiler:          # --profile (chapter 07)
        for step in range(start, cfg.train_iters):
            set_doing(f"iteration {step + 1}")
            microbatches = [local_microbatch(train_ds, step, cfg.micro_batch_size, m, cfg.grad_accum_steps, layout, device)
                            for m in range(cfg.grad_accum_steps)]
            lr = learning_rate(step, cfg)
            floor_scale = scale_cannot_go_lower(optimizer)       # before the step moves it
            last = step == cfg.train_iters - 1      # what it moves and how long the pipeline idles: run_report.py
            with record_communication() if last else nullcontext() as ledger:
                loss, grad_norm = train_step(chunks, optimizer, microbatches, layout, lr, p2p, cfg.pipeline_schedule,
                                             pipeline_records=result.pipeline_records if last else None)
            profiler.step()
            if ledger is not None:
                result.last_step_communication = list(ledger)
            loss_t = torch.tensor([loss], dtype=torch.float64, device=device)   # report the global batch's loss
            all_reduce(loss_t, layout.dp_group, op="avg", tag="loss")
            check_finite_step(step + 1, loss_t.item(), grad_norm, optimizer)
            result.losses.append(loss_t.item())
            done = step + 1
            if grad_norm is None:                    # the loss scaler skipped it (all ranks agree)
                result.skipped_steps += 1
            skipped_in_a_row = skipped_in_a_row + 1 if grad_norm is None and floor_scale else 0
            check_skipped_steps(done, skipped_in_a_row, done - start, cfg, optimizer)
            if cfg.eval_interval and (done % cfg.eval_interval == 0 or done == cfg.train_iters) and cfg.eval_iters:
                set_doing(f"evaluating after iteration {done}")
                result.eval_losses.append((done, evaluate(chunks, valid_ds, cfg, layout, p2p, device)))
            if progress is not None:
                tokens = cfg.seq_length * cfg.micro_batch_size * cfg.grad_accum_steps * layout.data_parallel_size
                progress.set_postfix(loss=f"{result.losses[-1]:.3f}", lr=f"{lr:.1e}",
                                     gnorm="skipped" if grad_norm is None else f"{grad_norm:.2f}",
                                     **({"skipped": result.skipped_steps} if result.skipped_steps else {}),
                                     tokens_per_s=f"{tokens * (done - start) / (time.perf_counter() - started):,.0f}")
                progress.update(1)
            exiting = bool(cfg.exit_interval) and done % cfg.exit_interval == 0 and done < cfg.train_iters
            if cfg.save_dir and ((cfg.save_interval and done % cfg.save_interval == 0) or done == cfg.train_iters
                                 or exiting):
                set_doing(f"saving iteration {done}")
                result.checkpoint = _save(cfg, model_cfg, done, chunks, optimizer, result, layout)
            if exiting:                         # Megatron's --exit-interval: saved first, then stop
                if layout.rank == 0:
                    print(f"--exit-interval {cfg.exit_interval}: stopping after iteration {done}")
                break
    result.seconds = time.perf_counter() - started
    if profiler.table is not None:                                     # rank 0
        print(f"--profile: steps {cfg.profile_step_start}..{cfg.profile_step_end - 1}, a Chrome trace per rank in "
              f"{profiler.trace.parent}; rank 0's operators by their own time:\n{profiler.table}")
    result.held_bytes = held_state_bytes(chunks, optimizer)
    if progress is not None:
        progress.close()
    if layout.rank == 0:
        write_history(result, cfg)
    return result


def held_parameters(chunks: list[nn.Module]) -> list[nn.Parameter]:
    """This rank's parameters over its chunks, each once (a tied weight is one parameter)."""
    return list({id(p): p for c in chunks for p in c.parameters()}.values())


def local_parameter_counts(chunks: list[nn.Module]) -> dict[str, int]:
    """{"dense", "experts"}: the parameter elements this rank holds (analysis.rank_parameters
    is their formula; run_report.py sets the two side by side)."""
    held = held_parameters(chunks)
    return {"dense": sum(p.numel() for p in held if not is_expert_parameter(p)),
            "experts": sum(p.numel() for p in held if is_expert_parameter(p))}


def held_state_bytes(chunks: list[nn.Module], optimizer: Optimizer) -> dict[str, int]:
    """The bytes this rank keeps from step to step: "parameters" (a tied weight once),
    "gradients" (the data-parallel wrappers' buffers: ZeRO-2's and ZeRO-3's gradient shards
    (their memory_tensors); without a wrapper, the .grad backward gives each
    parameter, as many bytes as the parameter), "main_parameters" (mixed precision: the
    optimizer's float32 copies) and "optimizer" (AdamW's two moments; its step counters left out)."""
    params = held_parameters(chunks)
    buffers = [b.grad_data for c in chunks for b in getattr(c, "buckets", []) if b.grad_data is not None]
    if any(hasattr(c, "memory_tensors") for c in chunks):   # ZeRO 1-3 (and a mixture's expert buckets): their own
        buffers = [t for c in chunks for t in c.memory_tensors()["grads"]]                 # accounting of them
    moments = [t for state in optimizer.state.values() for name, t in state.items() if name in ("exp_avg", "exp_avg_sq")]
    copies = [m for m, seg in zip(optimizer.main_params, optimizer.segments) if m is not seg.param]
    size = lambda tensors: sum(t.numel() * t.element_size() for t in tensors)     # noqa: E731
    return {"parameters": size(params), "gradients": storage_bytes(buffers) if buffers else size(params),
            "main_parameters": size(copies), "optimizer": size(moments)}


class NonFiniteError(RuntimeError):
    """The loss or the gradient norm of an iteration is inf or nan, the parameters about to be
    saved are, or the loss scaler skipped every step of a window: the run stops."""


def check_finite_step(iteration: int, loss: float, grad_norm: float | None, optimizer: Optimizer) -> None:
    """NonFiniteError naming `iteration` (counted from 1, as the checkpoints iter_N) when its
    loss or global gradient norm is inf or nan: from there on every parameter would be NaN,
    and the run would go on to save NaN checkpoints and exit 0. The run stops on every rank
    together: the loss (all-reduced over the pipeline and data-parallel groups) and the norm
    (all-reduced over every group that splits the model) are the same number on every rank.

    With a loss scaler (fp16) too. Its signal is an inf or nan in the *scaled gradients*: the
    step is skipped (Optimizer.step returns no norm, which is no error) and the scale lowered.
    The loss is not its signal: the loss is computed before the scale multiplies anything, so a
    non-finite loss means the forward overflowed or the weights are no longer finite, and no
    loss scale can undo that (skipping keeps the weights as they are). Megatron-LM turns its
    check off under dynamic loss scaling (check_for_nan_in_loss_and_grad, in
    megatron/training/arguments.py, d98e8a6, checked 2026-12-07), leaving the scaler as the only
    guard; here a non-finite loss stops the run."""
    bad = ([f"the loss is {loss}"] if not math.isfinite(loss) else []) + \
          ([f"the gradient norm is {grad_norm}"] if grad_norm is not None and not math.isfinite(grad_norm) else [])
    if bad:
        lr = optimizer.param_groups[0]["lr"]
        scaler = (f" at loss scale {optimizer.loss_scale:g}" if optimizer.grad_scaler is not None else "")
        raise NonFiniteError(f"iteration {iteration}: {' and '.join(bad)}{scaler}; training stopped before saving "
                             f"it (its learning rate was {lr:.3g}: too large a --lr, --init-method-std or loss weight "
                             f"is the usual cause)")


# a loss scale that cannot go lower (a constant one, or the dynamic one at its minimum) and
# whose gradients overflowed this many steps in a row stops the run: a skipped step leaves the
# weights as they were, so the next batch meets the same weights at the same scale, and only
# the batch changed; ten batches in a row that overflow say that the scale is too large
SKIPPED_STEPS_WINDOW = 10


def scale_cannot_go_lower(optimizer: Optimizer) -> bool:
    """Is the optimizer's loss scale where an overflow leaves it: constant (--loss-scale), or
    the dynamic one at --min-loss-scale? False without a loss scaler."""
    scaler = optimizer.grad_scaler
    return isinstance(scaler, ConstantGradScaler) or (isinstance(scaler, DynamicGradScaler)
                                                       and scaler.scale <= scaler.min_scale)


def check_skipped_steps(iteration: int, in_a_row: int, steps_run: int, cfg: TrainConfig,
                        optimizer: Optimizer) -> None:
    """NonFiniteError naming the loss scale when the last `in_a_row` steps (up to `iteration`)
    were all skipped at a scale that cannot go lower (scale_cannot_go_lower), and they are a
    whole window: SKIPPED_STEPS_WINDOW steps, or every step this run has made
    (`steps_run`) once it reaches its last iteration. Such a run trains nothing, and used to
    say nothing and exit 0. Every rank decides alike (the skip is agreed on every rank)."""
    window = min(SKIPPED_STEPS_WINDOW, steps_run if iteration == cfg.train_iters else SKIPPED_STEPS_WINDOW)
    if in_a_row == 0 or in_a_row < window:
        return
    scale = optimizer.loss_scale
    source = (f"--loss-scale {scale:g}" if cfg.loss_scale is not None else
              f"--min-loss-scale {cfg.min_loss_scale:g}, where the dynamic scale stopped")
    raise NonFiniteError(f"iterations {iteration - in_a_row + 1}-{iteration}: the loss scaler skipped every step: the "
                         f"gradients, scaled by {scale:g} ({source}), overflow on every batch, and the scale "
                         f"cannot go lower; training stopped before saving iteration {iteration}. Give a smaller "
                         f"{'--loss-scale (a power of 2)' if cfg.loss_scale is not None else '--min-loss-scale'}")


def check_finite_parameters(chunks: list[nn.Module], optimizer: Optimizer, step: int) -> None:
    """NonFiniteError before saving iteration `step` when a parameter this run would save (the
    model's, or the optimizer's float32 main copies) holds an inf or nan on any rank: a
    checkpoint is never written with non-finite weights. One all-reduce (max) over the world."""
    tensors = held_parameters(chunks) + list(optimizer.main_params)
    bad = sorted({name for c in chunks for name, p in unwrap(c).named_parameters() if not bool(torch.isfinite(p).all())})
    found = torch.tensor([float(bool(bad) or any(not bool(torch.isfinite(t).all()) for t in tensors))],
                         device=tensors[0].device if tensors else None)
    all_reduce(found, None, op="max", tag="checkpoint")
    if found.item():
        where = f" ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})" if bad else ""
        raise NonFiniteError(f"iteration {step}: parameters are not finite{where}; the checkpoint was not saved")


def holds_part_of_model(layout: Layout) -> bool:
    """Does each rank hold only a part of the model (tp, pp, ep or etp > 1)? Then each saves its
    own chunks' state dicts, which a resume with the same layout loads."""
    return layout.tp > 1 or layout.pp > 1 or layout.ep > 1 or layout.etp > 1


def _save(cfg, model_cfg, step, chunks, optimizer, result, layout: Layout) -> str:
    """One checkpoint (see checkpoint.py): every rank's own file first, then rank 0's main file.

    The main file's "model" is always the single-device state (names and full shapes: the
    shards gathered, a collective). When the model is split (TP or PP) each rank's own file
    also holds its chunks' own state dicts (ZeRO-3's parameters gathered over dp: collective),
    which is what a resume with the same layout loads."""
    check_finite_parameters(chunks, optimizer, step)
    if cfg.ckpt_format == "torch_dist":                      # any layout can resume it (chapter 08)
        common = {"model_config": to_dict(model_cfg), "train_config": to_dict(cfg),
                  "data_parallel_size": layout.data_parallel_size,
                  "history": {"losses": result.losses, "eval_losses": [list(x) for x in result.eval_losses]}}
        own = {"rng": torch.get_rng_state(), "tp_rng": get_rng_tracker().get_states()}
        return str(save_distributed(cfg.save_dir, step, chunks, optimizer, layout, common, own))
    split = holds_part_of_model(layout)
    model_state = full_model_tensors(chunks, layout)                      # collective
    own = {"optimizer": optimizer.state_dict(), "rng": torch.get_rng_state(), "tp_rng": get_rng_tracker().get_states(),
           "fp8": {name: state for c in chunks for name, state in delayed_scaling_states(c).items()},
           **({"model": [chunk_state(c) for c in chunks]} if split else {})}
    if layout.world > 1:
        save_rank_state(cfg.save_dir, step, layout.rank, own)
        barrier(None, tag="checkpoint")                           # all rank files exist
    path = Path(cfg.save_dir) / f"iter_{step:07d}.pt"
    if layout.rank == 0:
        main = {"model_config": to_dict(model_cfg), "train_config": to_dict(cfg), "model": model_state,
                "dp_size": layout.dp, "tp_size": layout.tp, "pp_size": layout.pp, "cp_size": layout.cp,
                "history": {"losses": result.losses, "eval_losses": [list(x) for x in result.eval_losses]}}
        path = save_checkpoint(cfg.save_dir, step, {**main, **(own if layout.world == 1 else {})})
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


def _progress_bar(start: int, cfg: TrainConfig):
    if not cfg.progress:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=cfg.train_iters, initial=start, desc="train", unit="step", dynamic_ncols=True)


def write_history(result: TrainResult, cfg: TrainConfig) -> None:
    """losses.json and loss.png in cfg.out_dir."""
    from .viz import plot_losses
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "losses.json").write_text(json.dumps({"train": result.losses, "eval": result.eval_losses}))
    plot_losses(result.losses, result.eval_losses, out / "loss.png")


def main(argv: Iterable[str] | None = None, *, before=None, after=None) -> int:
    """The command line. Under `torchrun --nproc_per_node=n` every rank runs this; rank 0 prints.

    `before(model_cfg, cfg, world)` and `after(model_cfg, cfg, result) -> exit status`, if given,
    run on every rank once the process group exists, before and after training, inside the
    same error handling (run_report.main passes its report and its check against one device).

    Exit status, the same on every rank: 0 trained; 2 a configuration, data or checkpoint
    that cannot be used (found by every rank, before any work or agreed on in one collective);
    1 the run failed: a non-finite loss or gradient norm (every rank sees the same one), or a
    collective timed out (the message names the ranks that did not arrive). Every rank finds
    the error, and the job prints it once (launch.print_once). After a timeout the world is
    broken: the rank leaves at once (finish_torchrun(world_broken=True)), without the barrier
    that would wait for the timeout a second time, and torchrun stops the others."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        model_cfg, cfg, cli = parse_command_line(argv, world)
        validate_layout(model_cfg, cfg, world)                  # before any process group
        if cfg.save_dir:
            check_save_dir(cfg.save_dir)                        # a file, read-only, /proc: named now
        rank = 0
        if world > 1:                                           # every group gets this timeout
            rank, _ = init_from_torchrun(timeout=60.0 * cli["distributed_timeout_minutes"], device=cfg.device)
        if rank == 0:
            dp = world // (cfg.tensor_model_parallel_size * cfg.context_parallel_size * cfg.pipeline_model_parallel_size)
            print(f"global batch {cfg.micro_batch_size * cfg.grad_accum_steps * dp} sequences = micro_batch_size "
                  f"{cfg.micro_batch_size} x {cfg.grad_accum_steps} micro-batches x data-parallel size {dp}")
        if before is not None:
            before(model_cfg, cfg, world)
        result = train(model_cfg, cfg)
        if rank == 0:
            final_eval = f", validation loss {result.eval_losses[-1][1]:.4f}" if result.eval_losses else ""
            skipped = (f" ({result.skipped_steps} step{'s' * (result.skipped_steps > 1)} of this run skipped by "
                       f"the loss scaler: the scaled gradients overflowed)" if result.skipped_steps else "")
            print(f"final train loss {result.losses[-1]:.4f}{final_eval}{skipped}")
            print(f"loss curve: {Path(cfg.out_dir) / 'loss.png'}")
        status = 0 if after is None else after(model_cfg, cfg, result)
    except (ConfigError, DataError, CheckpointError) as exc:
        print_once(f"error: {exc}")
        return finish_torchrun(2)
    except NonFiniteError as exc:
        print_once(f"error: {exc}")
        return finish_torchrun(1)
    except CollectiveTimeoutError as exc:
        print_once(f"error: {exc}", key="collective-timeout")     # the first rank to time out speaks
        return finish_torchrun(1, world_broken=True)
    return finish_torchrun(status)      # frees every group and its gloo threads before Python exits


if __name__ == "__main__":
    sys.exit(main())
