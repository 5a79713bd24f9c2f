"""Checkpoints that reshard: save under one layout, resume under any other (chapter 08 §2-§4).

    save_distributed(save_dir, step, chunks, optimizer, layout, common)   # every rank, collective
    common = load_distributed(path, chunks, optimizer, layout)            # every rank, no collective

No rank gathers: each writes what it holds, every piece tagged with where it sits in the
single-device model:

    (kind, name, global shape, local shape, boxes, flat)  +  the tensor

kind: "model", "main" (float32 main parameters), "exp_avg", "exp_avg_sq", "buffer", "fp8"
(delayed scaling states); name: the single-device name; boxes: the local tensor's global boxes
([lo, hi) per dimension, `boxes_of_local`) and where each sits locally; flat: the elements
[lo, hi) of the flattened local tensor the piece holds (a ZeRO shard's run for the optimizer).

Save (collective over the world, tag "checkpoint"): list the pieces; all_gather_object the
lists, and a piece several ranks hold (same `piece_identity`) is written by the lowest rank;
write `iter_XXXXXXX/rank_RRRRR.pt` atomically; a second all_gather_object brings the indexes to
rank 0, which writes `common.pt` (index, step, configs, history, loss scaler) and then `latest`;
a barrier. Every file carries CRC-32s (checkpoint.checksums), checked at read.

Load (every rank alone): per tensor, assemble the single-device tensor from the index's pieces
(every element must arrive), cut this rank's local tensor and each segment's run
(`segment_run`). One single-device tensor in memory at a time; files opened with
torch.load(mmap=True, weights_only=True). A 16-bit model loads from the float32 main copies.

Megatron: megatron/core/dist_checkpointing/ (ShardedTensor, strategies/torch.py: torch_dist).
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import comm
from .checkpoint import (CheckpointError, _atomic_write, check_same_model, latest_checkpoint, read_checked,
                         remove_stale_temporaries, write_checked)
from .dp import local_tensors, unwrap
from .fp8 import delayed_scaling_states, load_delayed_scaling_states
from .optim import Optimizer
from .parallel_state import Layout
from .placement import Placement

__all__ = ["FORMAT", "save_distributed", "load_distributed", "read_common", "is_distributed_checkpoint",
           "find_distributed_checkpoint", "boxes_of_local", "local_from_full", "segment_run", "checkpoint_pieces",
           "piece_identity", "layout_signature", "load_full_state", "save_release", "MAY_CHANGE"]

FORMAT = "minimegatron-torch_dist-v1"
COMMON = "common.pt"
# model config fields a resume may change: the precision (the float32 main parameters, or the
# parameters themselves, are cast to the new dtype)
MAY_CHANGE = ("params_dtype",)


def _new_iteration_dir(directory: str | os.PathLike, step: int) -> Path:
    """iter_{step:07d} of `directory`, created, without the `*.tmp` files of a killed save."""
    out = Path(directory) / f"iter_{step:07d}"
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out)
    return out


def is_distributed_checkpoint(path: str | os.PathLike) -> bool:
    """Is `path` (what `latest` names) a directory of this format?"""
    return (Path(path) / COMMON).is_file()


def find_distributed_checkpoint(load: str | os.PathLike, convert: str, hint: str = "") -> Path:
    """The torch_dist checkpoint `load` names: an iteration's directory, or the one `latest` names in
    it. CheckpointError "--load {load} ..." saying why there is none; `convert` is the command that
    makes one of a Hugging Face folder, `hint` ends the message for a folder without one."""
    path = Path(load)
    if is_distributed_checkpoint(path):
        return path
    found = latest_checkpoint(path, warn=False) if path.is_dir() else None
    if found is not None and is_distributed_checkpoint(found):
        return found
    why = ("does not exist" if not path.exists() else "is a file, not a checkpoint directory" if not path.is_dir()
           else f"is a Hugging Face folder, not a checkpoint ({convert} makes one of it)"
           if (path / "config.json").is_file() else f"holds no --ckpt-format torch_dist checkpoint{hint}")
    raise CheckpointError(f"--load {load} {why}")


# ---------------------------------------------------------------------------------------
# where a local tensor sits in the single-device one
# ---------------------------------------------------------------------------------------
def boxes_of_local(record: Placement, local_shape: tuple[int, ...]) -> list[tuple[list, list]]:
    """[(global box, local box)] of a local tensor of `local_shape` that a rank with placement
    `record` holds: for each stride block k of the split (record.local_pieces, in local order),
    its [lo, hi) per dimension in the single-device tensor of shape record.shape, and the
    [lo, hi) per dimension where it sits in the local tensor, such that
    local[local box] == full[global box]. Lists of [lo, hi] pairs of ints, one per dimension.

    An unsplit parameter: one box, all of it, at the same place. Split along dim d over tp
    ranks with stride s: the local tensor holds s blocks of local_shape[d] / s rows each, one
    after the other along d; block k's real rows are the global box's (the last rank of a padded
    vocabulary holds padding rows past the single-device size, in no box). A block with no real
    row (a rank holding only padding) is left out. Other dimensions are whole."""
    # BEGIN EXERCISE 8.1: a shard's global offsets | hint: record.local_pieces gives the single-device slices; along the split dimension the local tensor holds one block of rows per stride block, one after the other: where does block k start locally, and how many of its rows are real?
    out = []
    d = None if record.split is None else record.split.dim
    part = None if d is None else local_shape[d] // record.split.stride     # local rows of one block
    for k, box in enumerate(record.local_pieces(tuple(local_shape))):
        glob = [[s.start, s.stop] for s in box]
        if any(lo >= hi for lo, hi in glob):
            continue                                                        # only padding here
        loc = [[k * part, k * part + (hi - lo)] if i == d else [0, n]
               for i, ((lo, hi), n) in enumerate(zip(glob, local_shape))]
        out.append((glob, loc))
    return out
    # END EXERCISE


def _index(box: list) -> tuple[slice, ...]:
    return tuple(slice(lo, hi) for lo, hi in box)


def local_from_full(record: Placement, local_shape: tuple[int, ...], full: torch.Tensor) -> torch.Tensor:
    """The local tensor of `local_shape` a rank with `record` holds of the single-device `full`
    (padding rows zero, as tp.layers' load_full leaves them)."""
    local = full.new_zeros(local_shape)
    for glob, loc in boxes_of_local(record, local_shape):
        local[_index(loc)] = full[_index(glob)]
    return local


def segment_run(record: Placement, local_shape: tuple[int, ...], full: torch.Tensor, inside: int,
                n: int) -> torch.Tensor:
    """The n elements an optimizer segment holds of one parameter, from the single-device tensor
    `full` (the parameter's value, or one of its AdamW moments): the parameter's local tensor of
    `local_shape` on this rank (placement `record`: its tensor-parallel cut, stride blocks, a
    padded vocabulary's zero rows), flattened, elements [inside, inside + n). A 1-D tensor of n
    elements in full's dtype. Under ZeRO `inside` is where the segment's run starts in the
    parameter (optim.Segment.locations); without ZeRO the run is the whole local tensor."""
    # BEGIN EXERCISE 8.5: spot the bug in the resharding load | hint: a segment's offsets count elements of the tensor this rank holds, not of the single-device one: which tensor must be flattened before the run is cut?
    return local_from_full(record, local_shape, full).reshape(-1)[inside:inside + n]
    # END EXERCISE


# ---------------------------------------------------------------------------------------
# saving
# ---------------------------------------------------------------------------------------
def _pieces_of_tensor(kind, record, local_shape, tensor, flat=None):
    """One piece descriptor (and its data): `tensor` is the whole local tensor (flat None) or the
    elements [flat) of its flattening."""
    lo, hi = flat if flat is not None else (0, int(torch.Size(local_shape).numel()))
    return ({"kind": kind, "name": record.name, "shape": list(record.shape), "local_shape": list(local_shape),
             "boxes": boxes_of_local(record, tuple(local_shape)), "flat": [lo, hi]}, tensor.detach())


def checkpoint_pieces(chunks: list[nn.Module], optimizer: Optimizer | None) -> list[tuple[dict, torch.Tensor]]:
    """Every piece this rank holds (descriptor, tensor), before deduplication: the parameters as local
    tensors (ZeRO-3's gathered over dp: a collective), the buffers, FP8 layers' delayed scaling
    (whole), and the optimizer's main parameters and moments as runs of local tensors."""
    pieces = []
    for chunk in chunks:
        model = unwrap(chunk)
        for record, tensor in local_tensors(chunk).values():
            if not record.shared:                       # a last stage's tied copy: the first stage has it
                pieces.append(_pieces_of_tensor("model", record, tuple(tensor.shape), tensor))
        params = {name for name, _ in model.named_parameters()}
        for name, buf in model.state_dict().items():    # saved buffers (a router's expert bias)
            if name not in params:
                pieces.append(_pieces_of_tensor("buffer", Placement(name, tuple(buf.shape)), tuple(buf.shape), buf))
        for name, state in delayed_scaling_states(model).items():     # FP8: each layer's scales and amax histories
            pieces.append(_pieces_of_tensor("fp8", Placement(name, tuple(state.shape)), tuple(state.shape), state))
    if optimizer is None:
        return pieces
    for main, seg in zip(optimizer.main_params, optimizer.segments):
        state = optimizer.state.get(main, {})
        kinds = [("main", main)] * (main is not seg.param) + [(k, state[k]) for k in ("exp_avg", "exp_avg_sq")
                                                             if k in state]
        for (record, lo, hi), (shape, inside) in zip(seg.owners, seg.locations):
            if record.shared:
                continue
            for kind, tensor in kinds:
                pieces.append(_pieces_of_tensor(kind, record, tuple(shape), tensor.reshape(-1)[lo:hi],
                                                (inside, inside + hi - lo)))
    return pieces


def piece_identity(desc: dict) -> tuple:
    """What makes a piece descriptor (checkpoint_pieces) the same numbers as another rank's: two
    ranks whose pieces have equal identities hold equal tensors (replicas: data-parallel or
    context-parallel copies, a norm weight on every tensor-parallel rank), and save_distributed
    writes only one of them. Pieces that hold different elements of one tensor (tensor-parallel
    shards, ZeRO's runs of one local tensor on different data-parallel ranks) must differ.
    A tuple of hashable values, from the descriptor's kind, name, shape, local_shape, boxes
    and flat."""
    # BEGIN EXERCISE 8.2: spot the bug in the checkpoint's deduplication | hint: the same tensor name and the same boxes can be held by several ranks; which field still tells apart the parts of it that ZeRO gave to different data-parallel ranks?
    return (desc["kind"], desc["name"], str(desc["boxes"]), tuple(desc["local_shape"]), tuple(desc["flat"]))
    # END EXERCISE


def save_distributed(directory: str | os.PathLike, step: int, chunks: list[nn.Module], optimizer: Optimizer | None,
                     layout: Layout, common: dict[str, Any], own: dict[str, Any]) -> Path:
    """Write this rank's pieces of iteration `step` and its `own` state (random states); then rank 0
    writes the index and `common` (step, configs, history, ...), then `latest`. Collective over the
    world: two comm.all_gather_object (tag "checkpoint") and one barrier. Returns the directory."""
    out = _new_iteration_dir(directory, step)
    pieces = checkpoint_pieces(chunks, optimizer)
    listed = comm.all_gather_object([piece_identity(d) for d, _ in pieces], None, tag="checkpoint")
    written = {identity for identities in listed[:layout.rank] for identity in identities}
    mine = {}
    for n, (desc, tensor) in enumerate(pieces):
        if piece_identity(desc) not in written:           # the lowest rank holding a piece writes it, once
            written.add(piece_identity(desc))
            mine[f"{desc['kind']}/{desc['name']}/{n}"] = (desc, tensor)
    index = _write_rank_file(out, step, layout.rank, own, mine)
    index = comm.all_gather_object(index, None, tag="checkpoint")    # also: every file is written
    if layout.rank == 0:
        steps = [int(state["step"]) for state in (optimizer.state.values() if optimizer else []) if "step" in state]
        scaler = None if optimizer is None or optimizer.grad_scaler is None else optimizer.grad_scaler.state_dict()
        _write_common(out, {"format": FORMAT, "step": step, "layout": layout_signature(layout),
                            "adam_steps": steps[0] if steps else 0, "grad_scaler": scaler,
                            "index": [desc for part in index for desc in part], **common})
    comm.barrier(None, tag="checkpoint")                  # nobody runs ahead of `latest`
    return out


def _write_rank_file(out: Path, step: int, rank: int, own: dict, mine: dict[str, tuple[dict, torch.Tensor]]) -> list:
    """Write rank_{rank:05d}.pt of the pieces `mine` ({key: (descriptor, tensor)}); returns its index."""
    name = f"rank_{rank:05d}.pt"
    index = [dict(desc, key=key, file=name) for key, (desc, _) in mine.items()]
    write_checked(out / name, {"format": FORMAT, "step": step, "rank": rank, "own": own,
                               "tensors": {key: t.contiguous().clone() for key, (_, t) in mine.items()},
                               "index": index})
    return index


def _write_common(out: Path, body: dict) -> None:
    """Write the iteration directory `out`'s common.pt, then point `latest` at it."""
    write_checked(out / COMMON, body)
    _atomic_write(out.parent / "latest", lambda tmp: tmp.write_text(out.name + "\n"))


# ---------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------
class _Reader:
    """The pieces of one checkpoint, by (kind, name); files opened on first use (mmap), and
    their checksums checked then."""

    def __init__(self, path: Path, common: dict):
        self.path, self.files = path, {}
        self.pieces: dict[tuple[str, str], list[dict]] = defaultdict(list)
        for desc in common["index"]:
            self.pieces[(desc["kind"], desc["name"])].append(desc)

    def has(self, kind: str, name: str) -> bool:
        return (kind, name) in self.pieces

    def payload(self, name: str) -> dict:
        """The rank file `name` of the checkpoint, loaded once, its checksums checked."""
        file = self.path / name
        if name not in self.files:
            if not file.is_file():
                raise CheckpointError(f"{file} does not exist: the checkpoint in {self.path} is incomplete")
            self.files[name] = read_checked(file, {}, "", mmap=True)
        return self.files[name]

    def full(self, kind: str, name: str) -> torch.Tensor:
        """The single-device tensor `name` of `kind`, assembled from its pieces; CheckpointError
        when an element is missing."""
        pieces = self.pieces[(kind, name)]
        out, filled = None, torch.zeros(pieces[0]["shape"], dtype=torch.bool)
        for desc in pieces:
            data = self.payload(desc["file"])["tensors"][desc["key"]]
            out = torch.zeros(filled.shape, dtype=data.dtype) if out is None else out
            local = data.new_zeros(desc["local_shape"])            # the local tensor, with this piece's run
            have = torch.zeros(desc["local_shape"], dtype=torch.bool)
            lo, hi = desc["flat"]
            local.view(-1)[lo:hi] = data.reshape(-1)
            have.view(-1)[lo:hi] = True
            for glob, loc in desc["boxes"]:
                mask = have[_index(loc)]                   # the elements this piece holds
                out[_index(glob)][mask] = local[_index(loc)][mask]
                filled[_index(glob)] |= mask
        if not bool(filled.all()):
            raise CheckpointError(f"the checkpoint in {self.path} holds {int(filled.sum()):,} of the "
                                  f"{filled.numel():,} elements of {kind} {name}: a rank's file is missing "
                                  f"from its index, or it was written by another program")
        return out


def read_common(path: str | os.PathLike) -> dict:
    """The common part of the checkpoint directory `path` (index, step, configs, history), checked."""
    file = Path(path) / COMMON
    try:
        return read_checked(file, {"format": FORMAT}, f"a {FORMAT} file")
    except FileNotFoundError:
        raise CheckpointError(f"{file} does not exist: {path} is not a complete {FORMAT} checkpoint") from None


@torch.no_grad()
def load_distributed(path: str | os.PathLike, chunks: list[nn.Module], optimizer: Optimizer | None,
                     layout: Layout, *, model_config: dict | None = None, optimizer_state: bool = True
                     ) -> dict[str, Any]:
    """Fill this rank's model `chunks` (built for any layout) and, if given, `optimizer` from the
    checkpoint directory `path`, cutting each single-device tensor as this rank holds it now. Main
    parameters (and ZeRO-3's shards) are always filled; moments and loss scaler only with
    `optimizer_state`. Returns the common part (step, configs, history, loss scaler; "own": the
    saving rank's own state when this rank's file exists and the layout is the same). No collective.
    CheckpointError: another model (`model_config`, by field), a tensor missing or of another
    shape, a missing or unreadable file."""
    path = Path(path)
    common = read_common(path)
    if model_config is not None:
        check_same_model(common.get("model_config", {}), model_config, path, MAY_CHANGE)
    reader = _Reader(path, common)
    # what this rank holds, by single-device name (a tied copy's: the original's, the word
    # embedding): parameters, and the optimizer's runs of them
    wanted: dict[str, list] = defaultdict(list)
    for chunk in chunks:
        model = unwrap(chunk)
        params = {name for name, _ in model.named_parameters()}
        for p in model.parameters():
            wanted[p.placement.copy_of or p.placement.name].append(("param", p.placement, tuple(p.shape), p))
        for name, buf in model.state_dict().items():
            if name not in params:
                if not reader.has("buffer", name):
                    raise CheckpointError(f"checkpoint {path} has no buffer {name!r}")
                buf.copy_(reader.full("buffer", name))
        try:                                    # FP8 delayed scaling: a layer saved without it starts fresh
            load_delayed_scaling_states(model, {name: reader.full("fp8", name) for name in delayed_scaling_states(model)
                                                if reader.has("fp8", name)})
        except ValueError as exc:
            raise CheckpointError(f"checkpoint {path}: {exc}") from None
    segments = [] if optimizer is None else list(zip(optimizer.main_params, optimizer.segments))
    for i, (_, seg) in enumerate(segments):
        for (record, lo, hi), (shape, inside) in zip(seg.owners, seg.locations):
            wanted[record.copy_of or record.name].append(("run", record, tuple(shape), (i, lo, hi, inside)))

    moments = optimizer is not None and optimizer_state and all(reader.has("exp_avg", name) for name in wanted)
    if moments:                               # AdamW's state, as torch keeps it, filled below
        optimizer.adam.state.clear()
        for main, _ in segments:
            optimizer.adam.state[main] = {"step": torch.tensor(float(common["adam_steps"])),
                                          "exp_avg": torch.zeros_like(main), "exp_avg_sq": torch.zeros_like(main)}
    for name, targets in wanted.items():
        kind = "main" if reader.has("main", name) else "model"       # float32 or better: the main copy when saved
        if not reader.has(kind, name):
            raise CheckpointError(f"checkpoint {path} has no tensor {name!r} (another model, or one saved without it)")
        full = reader.full(kind, name)
        if tuple(full.shape) != tuple(targets[0][1].shape):
            raise CheckpointError(f"checkpoint {path} holds {name} with shape {list(full.shape)}, this model "
                                  f"{list(targets[0][1].shape)}")
        fulls = {kind: reader.full(kind, name) for kind in ("exp_avg", "exp_avg_sq")} if moments else {}
        for what, record, shape, target in targets:
            if what == "param":
                target.copy_(local_from_full(record, shape, full))
                continue
            i, lo, hi, inside = target
            main, seg = segments[i]
            run = segment_run(record, shape, full, inside, hi - lo)
            seg.param.reshape(-1)[lo:hi] = run.to(seg.param.dtype)           # the model's storage (ZeRO's shard)
            if main is not seg.param:
                main.reshape(-1)[lo:hi] = run.to(main.dtype)
            for kind, moment in fulls.items():
                optimizer.adam.state[main][kind].reshape(-1)[lo:hi] = \
                    segment_run(record, shape, moment, inside, hi - lo).to(main.dtype)
    if optimizer_state and optimizer is not None and optimizer.grad_scaler is not None and \
            common.get("grad_scaler") is not None:
        optimizer.grad_scaler.load_state_dict(common["grad_scaler"])
    own_file = path / f"rank_{layout.rank:05d}.pt"
    if common.get("layout") == layout_signature(layout) and own_file.is_file():
        common = dict(common, own=reader.payload(own_file.name)["own"])
    return common


def save_release(directory: str | os.PathLike, state: dict[str, torch.Tensor], common: dict[str, Any]) -> Path:
    """Write a single-device `state` ({name: tensor}) as the torch_dist checkpoint of iteration 0 in
    `directory`, marked a release (resumed as the model alone, as --finetune). One process, no
    group. `common`: at least "model_config". Returns the iteration's directory."""
    out = _new_iteration_dir(directory, 0)
    pieces = [_pieces_of_tensor("model", Placement(name, tuple(t.shape)), tuple(t.shape), t)
              for name, t in state.items()]
    index = _write_rank_file(out, 0, 0, {}, {f"model/{name}/{n}": piece for n, (name, piece) in
                                             enumerate(zip(state, pieces))})
    _write_common(out, {"format": FORMAT, "step": 0, "release": True, "layout": {}, "adam_steps": 0,
                        "grad_scaler": None, "index": index, "history": {"losses": [], "eval_losses": []}, **common})
    return out


def load_full_state(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The single-device model of the checkpoint directory `path`, {name: tensor} in its saved
    dtype (the parameters as the model held them, then the saved buffers): what an exporter
    (chapter 08's Hugging Face conversion) or a comparison reads. No process group needed."""
    path = Path(path)
    reader = _Reader(path, read_common(path))
    return {name: reader.full(kind, name) for kind, name in reader.pieces if kind in ("model", "buffer")}


def layout_signature(layout: Layout) -> dict[str, int]:
    """The sizes that decide which rank holds what: a checkpoint's random states are restored
    only under the same ones."""
    return {k: getattr(layout, k) for k in ("world", "tp", "pp", "cp", "dp", "ep", "etp")}
