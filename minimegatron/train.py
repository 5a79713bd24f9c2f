"""The training loop: one loop that every chapter's parallelism plugs into.

    python -m minimegatron.train --preset demo                     # the embedded corpus
    python -m minimegatron.train --preset tiny --train-iters 50 --hidden-size 32
    python -m minimegatron.train --data-path build/mydata/corpus --tokenizer tok.json ...
    python -m minimegatron.train --preset tiny --save-dir runs/ckpt --save-interval 10
    python -m minimegatron.train --preset tiny --load-dir runs/ckpt  # exact resume
    torchrun --standalone --nproc_per_node=2 -m minimegatron.train --zero-stage 1   # chapter 01
    torchrun --standalone --nproc_per_node=4 -m minimegatron.train --tensor-model-parallel-size 2  # 02
    torchrun --standalone --nproc_per_node=8 -m minimegatron.train --tensor-model-parallel-size 2 \
        --pipeline-model-parallel-size 2 --grad-accum-steps 4                                       # 03: 3D

One step (Megatron's train_step, without the parallel parts yet):

    for each of the grad_accum_steps micro-batches:       # gradient accumulation
        loss = mean token loss / grad_accum_steps; loss.backward()
    clip the global gradient norm to clip_grad
    set the learning rate for this step (warm-up, then cosine decay); AdamW step

The data order, the learning rate and the dropout RNG are functions of the step number and
of state saved in the checkpoint, so a run resumed at step k repeats the uninterrupted run's
losses bit for bit.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.distributed as dist

from . import parallel_state
from .checkpoint import (CheckpointError, latest_checkpoint, load_checkpoint, load_rank_state, save_checkpoint,
                         save_rank_state)
from .comm import all_reduce, barrier
from .config import ConfigError, ModelConfig, TrainConfig, to_dict
from .data import (DataError, GPTDataset, IndexedDataset, batch_for_step, build_default_corpus, build_tokenizer,
                   train_valid_split)
from .dp import build_data_parallel
from .launch import init_from_torchrun
from .model import GPTModel
from .pp.engine import PipelineEngine, PipelineOptimizer
from .pp.p2p import PipelineComm
from .pp.stages import build_stage_chunks
from .tp import (TensorParallelGPTModel, clip_tensor_parallel_grad_norm, full_parameters, get_rng_tracker,
                 model_parallel_manual_seed)

# ---------------------------------------------------------------------------------------
# presets: sizes that train in seconds to a minute on a laptop CPU
# ---------------------------------------------------------------------------------------
PRESETS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # (model overrides, train overrides); the model style is LLaMA unless --style gpt2
    "tiny": (dict(hidden_size=32, num_layers=2, num_attention_heads=4, max_position_embeddings=32),
             dict(seq_length=32, micro_batch_size=4, train_iters=40, eval_interval=20, lr_warmup_iters=4)),
    "demo": (dict(hidden_size=96, num_layers=3, num_attention_heads=6, num_query_groups=2,
                  max_position_embeddings=64),
             dict(seq_length=64, micro_batch_size=8, train_iters=300, eval_interval=50, lr_warmup_iters=30,
                  out_dir="runs/demo")),
}


# ---------------------------------------------------------------------------------------
# the pieces of a step
# ---------------------------------------------------------------------------------------
def learning_rate(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up from lr/warmup to lr over lr_warmup_iters steps, then cosine decay to
    min_lr at train_iters (Megatron's --lr-decay-style cosine). `step` counts from 0."""
    if step < cfg.lr_warmup_iters:
        return cfg.lr * (step + 1) / cfg.lr_warmup_iters
    decay_steps = max(1, cfg.train_iters - cfg.lr_warmup_iters)
    progress = min(1.0, (step - cfg.lr_warmup_iters) / decay_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only, not on biases and norm weights (as Megatron)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)


def forward_backward(model: torch.nn.Module, microbatches: list[dict[str, torch.Tensor]]) -> float:
    """Accumulate gradients over micro-batches; returns the mean loss of the global batch.

    Each micro-batch's mean token loss is divided by the number of micro-batches, so the
    accumulated gradient equals the gradient of the mean loss over the whole batch (all
    micro-batches have the same number of tokens).

    `model` may be a data-parallel wrapper (chapter 01): then every micro-batch but the last
    runs under `no_sync()` (no communication while accumulating) and `finish_grad_sync()`
    completes the gradient reduction after the last one.
    """
    if hasattr(model, "pipeline_step"):    # chapter 03: the schedule runs the micro-batches
        return model.pipeline_step(microbatches)
    data_parallel = hasattr(model, "finish_grad_sync")
    total = 0.0
    for i, mb in enumerate(microbatches):
        last = i == len(microbatches) - 1
        with model.no_sync() if data_parallel and not last else contextlib.nullcontext():
            losses = model(mb["tokens"], labels=mb["labels"])          # [b, s]
            loss = losses.mean() / len(microbatches)
            loss.backward()
        total += loss.item()
    if data_parallel:
        model.finish_grad_sync()
    return total


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, lr: float,
                   clip_grad: float, tensor_parallel: TensorParallelGPTModel | None = None) -> float:
    """Clip the global gradient norm, set the learning rate, step; returns the norm before clipping.

    A data-parallel optimizer (chapter 01) computes the global norm itself: under ZeRO each
    rank holds only a shard of the gradients, so the norm needs an all-reduce (and when it
    was built with tensor_parallel, one over the TP group too). A tensor-parallel model
    without a data-parallel wrapper (chapter 02) is passed as `tensor_parallel`: its norm sums
    over the TP group, counting the replicated parameters once.
    """
    if tensor_parallel is not None and hasattr(optimizer, "clip_grad_norm") and \
            getattr(optimizer, "tensor_parallel", None) is not tensor_parallel:
        # its norm would be this rank's shards' only: clipping silently wrong
        raise ValueError("optimizer_step(tensor_parallel=model): the data-parallel optimizer was built without "
                         "it; pass tensor_parallel=model to dp.build_data_parallel")
    if hasattr(optimizer, "clip_grad_norm"):
        norm = optimizer.clip_grad_norm(clip_grad)
    elif tensor_parallel is not None:
        norm = clip_tensor_parallel_grad_norm(tensor_parallel, clip_grad)
    else:
        params = [p for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, clip_grad) if clip_grad > 0 else \
            torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad()
    return float(norm)


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataset: GPTDataset, cfg: TrainConfig, dp_rank: int = 0, dp_size: int = 1,
             dp_group=None) -> float:
    """Mean loss over the first eval_iters global batches (micro_batch_size * dp_size
    sequences each) of the validation set; each data-parallel rank evaluates its slice."""
    pipeline = hasattr(model, "pipeline_evaluate")       # chapter 03: forward through the stages
    model.train(False) if not pipeline else None
    losses = []
    for i in range(cfg.eval_iters):
        mb = batch_for_step(dataset, i, cfg.micro_batch_size, 0, 1, dp_rank, dp_size)
        losses.append(model.pipeline_evaluate(mb, i) if pipeline else model(mb["tokens"], labels=mb["labels"]).mean().item())
    model.train(True) if not pipeline else None
    mean = torch.tensor([sum(losses) / max(1, len(losses))], dtype=torch.float64)
    if dp_group is not None:
        all_reduce(mean, dp_group, op="avg", tag="loss")
    return mean.item()


# ---------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------
@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)               # one per step, from step 0
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    out_dir: str = ""
    checkpoint: str | None = None


def build_datasets(model_cfg: ModelConfig, cfg: TrainConfig) -> tuple[GPTDataset, GPTDataset]:
    """Train and validation datasets; checks the tokenizer fits the model's vocabulary."""
    tokenizer = build_tokenizer(cfg.tokenizer)
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise ConfigError(f"tokenizer {cfg.tokenizer!r} has vocab_size={tokenizer.vocab_size} > "
                          f"model vocab_size={model_cfg.vocab_size}")
    prefix = cfg.data_path or build_default_corpus()
    indexed = IndexedDataset(prefix)
    train_docs, valid_docs = train_valid_split(indexed, valid_fraction=0.1)
    train = GPTDataset(indexed, cfg.seq_length, seed=cfg.data_seed, split=train_docs)
    valid = GPTDataset(indexed, cfg.seq_length, seed=cfg.data_seed, split=valid_docs)
    return train, valid


# What decides the rest of a run besides the saved state: resuming with other values would
# silently break the "bit-identical to the uninterrupted run" guarantee, so it is refused.
RESUME_MUST_MATCH = ("data_path", "tokenizer", "seq_length", "micro_batch_size", "grad_accum_steps",
                     "train_iters", "lr", "min_lr", "lr_warmup_iters", "weight_decay", "adam_beta1",
                     "adam_beta2", "adam_eps", "clip_grad", "data_seed", "zero_stage",
                     "tensor_model_parallel_size", "pipeline_model_parallel_size", "pipeline_schedule",
                     "num_virtual_stages_per_pipeline_rank")


def check_resume_config(saved: dict, cfg: TrainConfig, where: str) -> None:
    """CheckpointError naming every field in RESUME_MUST_MATCH that differs from the saved run."""
    now = to_dict(cfg)
    diffs = [f"{k}: checkpoint {saved.get(k)!r}, run {now[k]!r}" for k in RESUME_MUST_MATCH
             if k in saved and saved[k] != now[k]]
    if diffs:
        raise CheckpointError(f"cannot resume exactly from {where}: the training config differs: " + "; ".join(diffs))


@dataclass
class Grid:
    """Where this process sits on the grid of ranks: tp (fastest) x dp x pp (slowest),
    Megatron's order. A group of size 1 is None (nothing to communicate)."""
    rank: int = 0
    world: int = 1
    tp_size: int = 1
    tp_group: object = None
    dp_rank: int = 0
    dp_size: int = 1
    dp_group: object = None
    pp_rank: int = 0
    pp_size: int = 1
    pp_group: object = None
    embedding_group: object = None        # first + last pipeline stage (tied embeddings)


def parallel_context(tp: int = 1, pp: int = 1) -> Grid:
    """The grid for tensor_model_parallel_size `tp` and pipeline_model_parallel_size `pp`: one
    process is Grid(); under torchrun dp = world / (tp pp), and the ranks of one TP group are
    one data-parallel rank of one stage (same micro-batches). ConfigError, before any group
    is made, when the world does not split."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if tp < 1 or pp < 1 or world % (tp * pp):
        hint = (f"; start {tp * pp} (or a multiple of {tp * pp}) ranks with torchrun, e.g. `torchrun "
                f"--nproc_per_node={tp * pp} -m minimegatron.train --tensor-model-parallel-size {tp} "
                f"--pipeline-model-parallel-size {pp}`" if world == 1 and tp * pp > 1 else "")
        raise ConfigError(f"world size {world} is not divisible by tensor_model_parallel_size={tp} x "
                          f"pipeline_model_parallel_size={pp}{hint}")
    if world == 1:
        return Grid()
    if parallel_state.model_parallel_is_initialized() and (
            parallel_state.get_tensor_model_parallel_world_size() != tp
            or parallel_state.get_pipeline_model_parallel_world_size() != pp):
        parallel_state.destroy_model_parallel()            # another layout in the same world
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    dp_size = dist.get_world_size(dp_group)
    return Grid(dist.get_rank(), world, tp, parallel_state.get_tensor_model_parallel_group() if tp > 1 else None,
                dist.get_rank(dp_group), dp_size, dp_group if dp_size > 1 else None,
                parallel_state.get_pipeline_model_parallel_rank(), pp,
                parallel_state.get_pipeline_model_parallel_group() if pp > 1 else None,
                parallel_state.get_embedding_group() if pp > 1 else None)


def full_state_dict(engine: torch.nn.Module, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The single-device state dict; under ZeRO-3 the parameters are sharded and gathered first."""
    if hasattr(engine, "gather_parameters"):
        return engine.gather_parameters()
    return model.state_dict()


def build_pipeline(model_cfg: ModelConfig, cfg: TrainConfig, grid: Grid) -> PipelineEngine:
    """This rank's stage(s) of the pipeline (chapter 03), tensor-parallel when grid.tp_size > 1,
    each chunk in bucketed DDP over the data-parallel group when there is one."""
    chunks = build_stage_chunks(model_cfg, grid.pp_size, grid.pp_rank, cfg.num_virtual_stages_per_pipeline_rank,
                                tp_group=grid.tp_group)
    p2p = PipelineComm(parallel_state.get_group_ranks("pp"), grid.pp_rank, len(chunks),
                       (cfg.micro_batch_size, cfg.seq_length, model_cfg.hidden_size), model_cfg.dtype)
    element_size = torch.empty((), dtype=model_cfg.dtype).element_size()
    bucket = None if cfg.ddp_bucket_size is None else cfg.ddp_bucket_size * element_size
    return PipelineEngine(chunks, cfg.pipeline_schedule, cfg.grad_accum_steps, p2p, grid.pp_group,
                          grid.embedding_group, grid.dp_group, grid.tp_group, bucket_size_bytes=bucket)


def train(model_cfg: ModelConfig, cfg: TrainConfig) -> TrainResult:
    """Train from scratch or resume from cfg.load_dir; returns the loss history.

    On one process this is the baseline. Under torchrun (or `launch.spawn`) with n ranks it
    trains data-parallel: each rank takes its slice of every global batch of
    micro_batch_size * grad_accum_steps * n sequences, and `cfg.zero_stage` / `cfg.ddp_impl`
    pick the variant of chapter 01. With cfg.tensor_model_parallel_size = t > 1 (chapter 02)
    the ranks form a t x (n / t) grid: every matrix is split over a TP group of t ranks, and
    the n / t TP groups are the data-parallel ranks. With cfg.pipeline_model_parallel_size =
    p > 1 (chapter 03) the layers are cut into p stages and each step runs
    cfg.pipeline_schedule over the grad_accum_steps micro-batches: t x p x (n / t p), 3D.
    """
    model_cfg.validate()
    grid = parallel_context(cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size)  # does it split?
    cfg.validate(model_cfg)
    dp_rank, dp_size, dp_group = grid.dp_rank, grid.dp_size, grid.dp_group
    train_ds, valid_ds = build_datasets(model_cfg, cfg)
    pipeline = build_pipeline(model_cfg, cfg, grid) if grid.pp_size > 1 else None
    tp_model = TensorParallelGPTModel(model_cfg, grid.tp_group) if grid.tp_size > 1 and pipeline is None else None
    model = pipeline.module if pipeline else tp_model if tp_model is not None else GPTModel(model_cfg)
    split = pipeline is not None or tp_model is not None        # each rank holds a part of the model
    # dropout masks, seeded after the model is built (building may draw from the default
    # generator, and must not shift the masks): under TP a stream shared by the TP group for
    # the replicated activations and one per TP rank for the split ones (tp/random.py); each
    # pipeline stage its own (Megatron adds 100 x pp_rank)
    if split:
        model_parallel_manual_seed(cfg.data_seed, pp_rank=grid.pp_rank)   # tp_rank from parallel_state
    else:
        torch.manual_seed(cfg.data_seed)
    result = TrainResult(out_dir=cfg.out_dir)

    state = own = None
    if cfg.load_dir and latest_checkpoint(cfg.load_dir) is not None:
        state = load_checkpoint(cfg.load_dir, model_config=to_dict(model_cfg))
        saved = (state.get("tp_size", 1), state.get("pp_size", 1), state.get("dp_size", 1))
        if saved != (grid.tp_size, grid.pp_size, dp_size):
            raise CheckpointError(f"checkpoint in {cfg.load_dir} was written by tp_size={saved[0]} x pp_size="
                                  f"{saved[1]} x dp_size={saved[2]} ranks, this run has tp_size={grid.tp_size} x "
                                  f"pp_size={grid.pp_size} x dp_size={dp_size}")
        check_resume_config(state.get("train_config", {}), cfg, cfg.load_dir)
        own = state if grid.world == 1 else load_rank_state(cfg.load_dir, state["step"], grid.rank)
        # before sharding (ZeRO-3); under TP or PP each rank's file holds its own part
        model.load_state_dict(own["model"] if split else state["model"])
    if pipeline is not None:         # the schedule, DP sync and norm live in the engine
        engine, optimizer = pipeline, PipelineOptimizer(build_optimizer(model, cfg), pipeline)
    elif dp_group is None:           # one data-parallel rank: nothing to average or to shard
        engine, optimizer = model, build_optimizer(model, cfg)
    else:
        engine, optimizer = build_data_parallel(model, cfg, dp_group, tensor_parallel=tp_model)

    start = 0
    if state is not None:
        optimizer.load_state_dict(own["optimizer"])
        torch.set_rng_state(own["rng"])
        if split:
            get_rng_tracker().set_states(own["tp_rng"])
        start = state["step"]
        result.losses = list(state["history"]["losses"])
        result.eval_losses = [tuple(x) for x in state["history"]["eval_losses"]]

    progress = _progress_bar(start, cfg) if grid.rank == 0 else None
    for step in range(start, cfg.train_iters):
        microbatches = [batch_for_step(train_ds, step, cfg.micro_batch_size, m, cfg.grad_accum_steps,
                                       dp_rank, dp_size) for m in range(cfg.grad_accum_steps)]
        loss = forward_backward(engine, microbatches)
        lr = learning_rate(step, cfg)
        grad_norm = optimizer_step(engine, optimizer, lr, cfg.clip_grad, tensor_parallel=tp_model)
        if dp_group is not None:                                   # report the global batch's loss
            loss_t = torch.tensor([loss], dtype=torch.float64)
            all_reduce(loss_t, dp_group, op="avg", tag="loss")
            loss = loss_t.item()
        result.losses.append(loss)
        done = step + 1
        if cfg.eval_interval and (done % cfg.eval_interval == 0 or done == cfg.train_iters) and cfg.eval_iters:
            result.eval_losses.append((done, evaluate(engine, valid_ds, cfg, dp_rank, dp_size, dp_group)))
        if progress is not None:
            progress.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.1e}", gnorm=f"{grad_norm:.2f}")
            progress.update(1)
        if cfg.save_dir and ((cfg.save_interval and done % cfg.save_interval == 0) or done == cfg.train_iters):
            result.checkpoint = _save(cfg, model_cfg, done, engine, model, optimizer, result, grid)
    if progress is not None:
        progress.close()
    if grid.rank == 0:
        write_history(result, cfg)
    return result


def _save(cfg, model_cfg, step, engine, model, optimizer, result, grid: Grid) -> str:
    """One checkpoint (see checkpoint.py): every rank's own file first, then rank 0's main file.

    The main file's "model" is always the single-device state (names and full shapes): under
    TP the shards are gathered (a collective over the TP group). Under TP each rank's own file
    also holds its shard ("model"), which is what a resume with the same layout loads."""
    split = grid.tp_size > 1 or grid.pp_size > 1
    if grid.pp_size > 1:                                          # collectives
        model_state = engine.full_state_dict()
    else:
        model_state = full_parameters(model) if split else full_state_dict(engine, model)
    own = {"optimizer": optimizer.state_dict(), "rng": torch.get_rng_state(),
           **({"model": model.state_dict(), "tp_rng": get_rng_tracker().get_states()} if split else {})}
    if grid.world > 1:
        save_rank_state(cfg.save_dir, step, grid.rank, own)
        barrier(None, tag="checkpoint")                           # all rank files exist
    path = Path(cfg.save_dir) / f"iter_{step:07d}.pt"
    if grid.rank == 0:
        main = {"model_config": to_dict(model_cfg), "train_config": to_dict(cfg), "model": model_state,
                "dp_size": grid.dp_size, "tp_size": grid.tp_size, "pp_size": grid.pp_size,
                "history": {"losses": result.losses, "eval_losses": [list(x) for x in result.eval_losses]}}
        path = save_checkpoint(cfg.save_dir, step, {**main, **(own if grid.world == 1 else {})})
    if grid.world > 1:
        barrier(None, tag="checkpoint")                           # nobody runs ahead of `latest`
    return str(path)


def _progress_bar(start: int, cfg: TrainConfig):
    if not cfg.progress:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=cfg.train_iters, initial=start, desc="train", unit="step", dynamic_ncols=True)


def write_history(result: TrainResult, cfg: TrainConfig) -> None:
    """losses.json and loss.png in cfg.out_dir."""
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "losses.json").write_text(json.dumps({"train": result.losses, "eval": result.eval_losses}))
    plot_losses(result, out / "loss.png")


def plot_losses(result: TrainResult, path: str | os.PathLike) -> None:
    # A Figure with its own Agg canvas: no pyplot, so a notebook's backend is left alone.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(range(1, len(result.losses) + 1), result.losses, label="train (per step)", lw=1)
    if result.eval_losses:
        steps, values = zip(*result.eval_losses)
        ax.plot(steps, values, "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---------------------------------------------------------------------------------------
# command line: every config field is a flag (--hidden-size, --train-iters, ...)
# ---------------------------------------------------------------------------------------
def _add_dataclass_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        kind = {"int": int, "float": float, "str": str, "bool": None}.get(
            str(f.type).replace(" | None", "").strip("'"), str)
        if kind is None:
            parser.add_argument(flag, dest=f.name, type=lambda v: v.lower() in ("1", "true", "yes"), default=None)
        else:
            parser.add_argument(flag, dest=f.name, type=kind, default=None)


def configs_from_args(argv: Iterable[str] | None = None) -> tuple[ModelConfig, TrainConfig]:
    parser = argparse.ArgumentParser(prog="python -m minimegatron.train", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--style", choices=["llama", "gpt2"], default="llama")
    _add_dataclass_flags(parser, ModelConfig)
    _add_dataclass_flags(parser, TrainConfig)
    args = vars(parser.parse_args(None if argv is None else list(argv)))
    model_over, train_over = PRESETS[args.pop("preset")]
    style = args.pop("style")
    model_names = {f.name for f in dataclasses.fields(ModelConfig)}
    given = {k: v for k, v in args.items() if v is not None}
    model_cfg = getattr(ModelConfig, style)(**{**model_over, **{k: v for k, v in given.items() if k in model_names}})
    train_cfg = TrainConfig(**{**train_over, **{k: v for k, v in given.items() if k not in model_names}})
    return model_cfg, train_cfg


def main(argv: Iterable[str] | None = None) -> int:
    """The command line. Under `torchrun --nproc_per_node=n` every rank runs this; rank 0 prints."""
    try:
        model_cfg, cfg = configs_from_args(argv)
        model_cfg.validate()
        cfg.validate(model_cfg)                                    # before any process group exists
        rank = 0
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            rank, _ = init_from_torchrun()
        result = train(model_cfg, cfg)
    except (ConfigError, DataError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if rank == 0:
        final_eval = f", validation loss {result.eval_losses[-1][1]:.4f}" if result.eval_losses else ""
        print(f"final train loss {result.losses[-1]:.4f}{final_eval}")
        print(f"loss curve: {Path(cfg.out_dir) / 'loss.png'}")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
