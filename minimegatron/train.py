"""The training loop: one step and one loop that every chapter's parallelism plugs into.

    python -m minimegatron.train --help                               # every flag, by group (arguments.py)
    python -m minimegatron.train --preset tiny --save runs/ckpt --save-interval 10
    python -m minimegatron.train --preset tiny --load runs/ckpt       # exact resume (resume.py)
    python -m minimegatron.train --preset tiny --load runs/ckpt --save runs/ckpt --train-iters 80   # extend it
    torchrun --standalone --nproc_per_node=2 -m minimegatron.train --zero-stage 1   # chapter 01
    torchrun --standalone --nproc_per_node=8 -m minimegatron.train --tensor-model-parallel-size 2 \
        --pipeline-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 8   # 03: 3D, dp 2, 4 micro-batches
    torchrun --standalone --nproc_per_node=16 -m minimegatron.train --preset demo --num-layers 4 \
        --tensor-model-parallel-size 2 --sequence-parallel --context-parallel-size 2 \
        --num-experts 8 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2 --expert-model-parallel-size 2 \
        --pipeline-model-parallel-size 2 --micro-batch-size 1 --grad-accum-steps 4   # 05: 5D GPT-MoE (make demo)

    train_step       forward and backward of the micro-batches, finalize_model_grads, optimizer_step
    train            the layout, the checkpoint (resume.py), the model, the loop, the checkpoints
    main             the command line; what stops a run (every rank together) and its exit status

The data order, the learning rate and the dropout RNG are functions of the step number and of
state saved in the checkpoint, so a run resumed at step k repeats the uninterrupted run's losses
bit for bit.
"""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from tqdm.auto import tqdm

from .analysis.memory import held_state_bytes, local_parameter_counts
from .arguments import parse_command_line
from .checkpoint import CheckpointError, all_ranks_agree, check_save_dir, lock_save_dir
from .comm import all_reduce, record_communication
from .config import ConfigError, ModelConfig, TrainConfig
from .cp import get_batch_on_this_cp_rank
from .data import (DataError, GPTDataset, IndexedDataset, batch_for_step, build_default_corpus, build_tokenizer,
                   train_valid_split)
from .dp import no_sync
from .launch import finish_torchrun, init_from_torchrun, print_once
from .model import finalize_model_grads, mean_loss
from .model.moe import set_moe_aux_loss_scale
from .nonfinite import (NonFiniteError, check_finite_parameters, check_finite_step, check_skipped_steps,
                        scale_cannot_go_lower)
from .optim import Optimizer, learning_rate, set_learning_rate
from .parallel_state import Layout
from .parallelize import build_model, build_optimizer, layout_device, validate_layout
from .pp import PipelineComm, evaluate_pipelining, forward_backward_pipelining
from .pp.timeline import StepRecord
from .profiling import StepProfiler
from .resume import Checkpoint, initialize_layout, open_checkpoint, restore_state, save_state
from .tp import model_parallel_manual_seed
from .watchdog import CollectiveTimeoutError, is_collective_timeout, missing_ranks_report, set_doing

# ---------------------------------------------------------------------------------------
# one step
# ---------------------------------------------------------------------------------------
def forward_backward_no_pipelining(model: nn.Module, microbatches: list[dict[str, torch.Tensor]],
                                   loss_scale: float = 1.0, record: StepRecord | None = None) -> float:
    """Accumulate gradients over micro-batches; returns the mean loss of the global batch.

    Each micro-batch's mean token loss is divided by their number (the accumulated gradient is
    the gradient of the batch's mean loss); all but the last run under no_sync() (no DP
    communication); the backward starts from the loss times `loss_scale` (1 without a loss
    scaler). `record`, if given, measures what each micro-batch's forward saves for its backward."""
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
               records: list[StepRecord] | None = None) -> tuple[float, float | None]:
    """One optimizer step over this rank's share of the global batch's micro-batches,
    Megatron's train_step, the same code on every layout:

        forward and backward of the micro-batches    pp > 1: the pipeline schedule (`p2p`, `schedule`)
                                                      else: accumulate, DP sync on the last one
        finalize_model_grads                         every gradient hook the chunks registered
        optimizer_step                               (loss scale,) clip, AdamW, copy back; zero_grad

    Returns (the mean loss of this data-parallel rank's micro-batches, the global gradient norm
    before clipping or None: the loss scaler skipped the step). `records`, if given, receives the
    step's pp.timeline.StepRecord; `with before_optimizer_step(optimizer, fn)` sees the gradients."""
    scale = optimizer.loss_scale
    set_moe_aux_loss_scale(chunks, scale / len(microbatches))   # MoE: aux losses weigh as the LM loss
    if layout.pp > 1:
        loss, record = forward_backward_pipelining(chunks, microbatches, p2p, schedule, layout.pp_group, scale)
    else:
        record = None if records is None else StepRecord(
            layout.rank, params={p.untyped_storage().data_ptr() for p in chunks[0].parameters()})
        loss = forward_backward_no_pipelining(chunks[0], microbatches, scale, record)
    if records is not None:
        records.append(record)
    finalize_model_grads(chunks)
    return loss, optimizer_step(optimizer, lr)


def optimizer_step(optimizer: Optimizer, lr: float) -> float | None:
    """Once the gradients are final: the learning rate, optimizer.step() (clip, AdamW), zero_grad;
    returns the norm (None: the loss scaler skipped the step). A demo that writes out its own
    forward and backward calls finalize_model_grads, then this."""
    set_learning_rate(optimizer, lr)
    grad_norm = optimizer.step()
    optimizer.zero_grad()
    return grad_norm


@contextmanager
def before_optimizer_step(optimizer: Optimizer, fn: Callable[[], object]) -> Iterator[None]:
    """Inside the block each optimizer.step() first calls fn(), where the gradients are final and
    not yet read: a test or demo looks at them, or breaks one. torch.optim's register_step_pre_hook
    for one block (optim.Optimizer is the book's own, not a torch.optim.Optimizer)."""
    step = optimizer.step

    def fn_then_step() -> float | None:
        fn()
        return step()

    optimizer.step = fn_then_step
    try:
        yield
    finally:
        optimizer.step = step


@torch.no_grad()
def evaluate(chunks: list[nn.Module], dataset: GPTDataset, cfg: TrainConfig, layout: Layout,
             p2p: PipelineComm | None = None, device: torch.device | str = "cpu") -> float:
    """Mean loss over the first eval_iters global batches (micro_batch_size x dp sequences each)
    of the validation set; each data-parallel rank evaluates its slice (cp rank: its tokens)."""
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
    """Micro-batch `index` of `step` as this rank sees it: its data-parallel replica's sequences,
    its context-parallel rank's tokens of them: {"tokens", "labels": [b, s/cp], "position_ids": [s/cp]}."""
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
    indexed = IndexedDataset(cfg.data_path or build_default_corpus(), vocab_size=model_cfg.vocab_size)  # ids < vocab
    masks = dict(eod=tokenizer.eod, reset_position_ids=cfg.reset_position_ids,
                 reset_attention_mask=cfg.reset_attention_mask, eod_mask_loss=cfg.eod_mask_loss)
    return tuple(GPTDataset(indexed, cfg.seq_length, seed=cfg.data_seed, split=docs, **masks)     # train, valid
                 for docs in train_valid_split(indexed, valid_fraction=0.1))


def train(model_cfg: ModelConfig, cfg: TrainConfig) -> TrainResult:
    """Train from scratch or resume from cfg.load_dir; returns the loss history.

    One process is the baseline. n ranks (torchrun, launch.spawn) form a tp x cp x dp x pp grid
    (Megatron's order, tp fastest; a GPT-MoE's experts their own etp x ep x expert-dp x pp):
    the model split over tp (02, SP: 04), each sequence over cp (04), the layers over pp stages
    (03), dp = n / (tp cp pp) replicas each taking its slice of every global batch (01).
    Each rank opens the checkpoint, then all agree (resume.py); rank 0 holds cfg.save_dir's lock.
    Every rank together raises NonFiniteError (nonfinite.py) or, when a collective times out,
    watchdog.CollectiveTimeoutError naming the ranks that did not arrive."""
    validate_layout(model_cfg, cfg, dist.get_world_size() if dist.is_initialized() else 1)
    return _train(model_cfg, cfg)


def _train(model_cfg: ModelConfig, cfg: TrainConfig) -> TrainResult:
    """train's body, once validate_layout has passed (main runs it before any process group):
    the layout's groups, the save directory's lock and the checkpoint to resume (each rank
    apart, then all agree), then the run."""
    layout = initialize_layout(cfg)
    lock = checkpoint = None
    try:
        train_ds, valid_ds = build_datasets(model_cfg, cfg)
        error = None
        try:
            if cfg.save_dir and layout.rank == 0:
                lock = lock_save_dir(cfg.save_dir)
            if cfg.load_dir:
                checkpoint = open_checkpoint(model_cfg, cfg, layout)
        except Exception as exc:               # noqa: BLE001 - whatever it is, every rank must hear of it
            error = exc
        if cfg.save_dir or cfg.load_dir:       # the same on every rank: all call it, or none
            all_ranks_agree(error, " and ".join(["taking the lock of save_dir"] * bool(cfg.save_dir) +
                                                ["loading the checkpoint"] * bool(cfg.load_dir)))
        if layout.rank == 0 and lock is not None and lock.previous:
            print(f"note: took over the lock of {cfg.save_dir}, left by a run that ended without releasing it "
                  f"(pid {lock.previous.get('pid')}, started {lock.previous.get('started')})")
        if layout.rank == 0 and checkpoint is not None:
            print(checkpoint.line)
        return _run(model_cfg, cfg, layout, train_ds, valid_ds, checkpoint)
    except RuntimeError as exc:
        if layout.world > 1 and is_collective_timeout(exc) and not isinstance(exc, CollectiveTimeoutError):
            raise CollectiveTimeoutError(missing_ranks_report(exc)) from exc
        raise
    finally:
        if lock is not None:
            lock.release()


def _run(model_cfg: ModelConfig, cfg: TrainConfig, layout: Layout, train_ds: GPTDataset, valid_ds: GPTDataset,
         checkpoint: Checkpoint | None) -> TrainResult:
    """Build the model and the optimizer (restored from `checkpoint`, if any), then the loop."""
    chunks = build_model(model_cfg, cfg, layout, load=checkpoint.model_states if checkpoint else None)
    # dropout masks, seeded once built (building draws): per TP group, TP rank and stage (tp/random.py)
    model_parallel_manual_seed(cfg.data_seed, tp_rank=layout.tp_rank, pp_rank=layout.pp_rank)
    optimizer = build_optimizer(chunks, cfg, layout)
    device = layout_device(cfg)
    p2p = None
    if layout.pp > 1:        # what travels between stages: [b, s/cp, h], and [b, s/(cp tp), h] under SP
        local_seq = cfg.seq_length // layout.cp // (layout.tp if cfg.sequence_parallel else 1)
        p2p = PipelineComm(layout.pp_ranks, layout.pp_rank, len(chunks),
                           (cfg.micro_batch_size, local_seq, model_cfg.hidden_size), model_cfg.dtype, device,
                           overlap_p2p_comm=cfg.overlap_p2p_comm)
    result = TrainResult(local_parameters=local_parameter_counts(chunks))
    start = 0
    if checkpoint is not None:
        restore_state(checkpoint, chunks, optimizer, model_cfg, cfg, layout)
        start, result.losses, result.eval_losses = checkpoint.step, checkpoint.losses, checkpoint.eval_losses

    if start >= cfg.train_iters and layout.rank == 0:      # a resume with nothing left to do says so
        print(f"resumed at iteration {start}, and --train-iters is {cfg.train_iters}: nothing left to train"
              + (f", nothing saved to {cfg.save_dir}" if cfg.save_dir else "")
              + f" (a --train-iters above {start} continues the run)")
    progress = tqdm(total=cfg.train_iters, initial=start, desc="train", unit="step", dynamic_ncols=True,
                    disable=not cfg.progress or layout.rank != 0)          # the bar: rank 0's, unless --no-progress
    skipped_in_a_row = 0                         # skipped steps at a loss scale that cannot go lower
    started = time.perf_counter()
    with StepProfiler(cfg, layout.rank, cfg.out_dir) as profiler:          # --profile (chapter 07)
        for step in range(start, cfg.train_iters):
            done = step + 1
            set_doing(f"iteration {done}")
            microbatches = [local_microbatch(train_ds, step, cfg.micro_batch_size, m, cfg.grad_accum_steps, layout, device)
                            for m in range(cfg.grad_accum_steps)]
            lr = learning_rate(step, cfg)
            floor_scale = scale_cannot_go_lower(optimizer)       # before the step moves it
            last = done == cfg.train_iters      # what it moves and how long the pipeline idles: run_report.py
            with record_communication() if last else nullcontext() as ledger:
                loss, grad_norm = train_step(chunks, optimizer, microbatches, layout, lr, p2p, cfg.pipeline_schedule,
                                             records=result.pipeline_records if last else None)
            profiler.step()
            if last:
                result.last_step_communication = list(ledger)
            loss_t = torch.tensor([loss], dtype=torch.float64, device=device)   # report the global batch's loss
            all_reduce(loss_t, layout.dp_group, op="avg", tag="loss")
            check_finite_step(done, loss_t.item(), grad_norm, optimizer)
            result.losses.append(loss_t.item())
            if grad_norm is None:                    # the loss scaler skipped it (all ranks agree)
                result.skipped_steps += 1
            skipped_in_a_row = skipped_in_a_row + 1 if grad_norm is None and floor_scale else 0
            check_skipped_steps(done, skipped_in_a_row, done - start, cfg, optimizer)
            if cfg.eval_interval and (done % cfg.eval_interval == 0 or done == cfg.train_iters) and cfg.eval_iters:
                set_doing(f"evaluating after iteration {done}")
                result.eval_losses.append((done, evaluate(chunks, valid_ds, cfg, layout, p2p, device)))
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
                check_finite_parameters(chunks, optimizer, done)
                save_state(cfg, model_cfg, done, chunks, optimizer, layout, result.losses, result.eval_losses)
            if exiting:                         # Megatron's --exit-interval: saved first, then stop
                if layout.rank == 0:
                    print(f"--exit-interval {cfg.exit_interval}: stopping after iteration {done}")
                break
    result.seconds = time.perf_counter() - started
    if profiler.table is not None:                                     # rank 0
        print(f"--profile: steps {cfg.profile_step_start}..{cfg.profile_step_end - 1}, a Chrome trace per rank in "
              f"{profiler.trace.parent}; rank 0's operators by their own time:\n{profiler.table}")
    result.held_bytes = held_state_bytes(chunks, optimizer)
    progress.close()
    if layout.rank == 0:
        write_history(result, cfg)
    return result


def write_history(result: TrainResult, cfg: TrainConfig) -> None:
    """losses.json and loss.png in cfg.out_dir."""
    from .viz import plot_losses
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "losses.json").write_text(json.dumps({"train": result.losses, "eval": result.eval_losses}))
    plot_losses(result.losses, result.eval_losses, out / "loss.png")


def main(argv: Iterable[str] | None = None, *, before=None, after=None) -> int:
    """The command line; under torchrun every rank runs it, rank 0 prints. `before(model_cfg, cfg,
    world)` and `after(model_cfg, cfg, result) -> exit status` run on every rank around training,
    inside the same error handling (run_report.main's report and check).

    Exit status, the same on every rank: 0 trained; 2 a configuration, data or checkpoint that
    cannot be used; 1 a non-finite run (nonfinite.py) or a collective that timed out. The job
    prints the error once (launch.print_once); after a timeout the rank leaves at once, without
    the barrier that would wait for the timeout again (finish_torchrun(world_broken=True))."""
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
        result = _train(model_cfg, cfg)                        # validated above
        if rank == 0:
            final_eval = f", validation loss {result.eval_losses[-1][1]:.4f}" if result.eval_losses else ""
            skipped = (f" ({result.skipped_steps} step{'s' * (result.skipped_steps > 1)} of this run skipped by "
                       f"the loss scaler: the scaled gradients overflowed)" if result.skipped_steps else "")
            print(f"final train loss {result.losses[-1]:.4f}{final_eval}{skipped}")
            print(f"loss curve: {Path(cfg.out_dir) / 'loss.png'}")
        status = 0 if after is None else after(model_cfg, cfg, result)
    except (ConfigError, DataError, CheckpointError, NonFiniteError) as exc:
        print_once(f"error: {exc}")
        return finish_torchrun(1 if isinstance(exc, NonFiniteError) else 2)
    except CollectiveTimeoutError as exc:
        print_once(f"error: {exc}", key="collective-timeout")     # the first rank to time out speaks
        return finish_torchrun(1, world_broken=True)
    return finish_torchrun(status)      # frees every group and its gloo threads before Python exits


if __name__ == "__main__":
    sys.exit(main())
