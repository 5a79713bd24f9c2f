"""Chapter 08 demo: a run saved under one layout resumes under another (--ckpt-format torch_dist).

    python chapters/08_capstone/demo.py              # spawns 4 ranks: the grid below, about a minute
    python chapters/08_capstone/demo.py --quick      # three pairs (what the tests run)

Every pair trains the book's tiny LLaMA-style model (float64, so that only summation order
separates two layouts) with the training command's own `train()`: 2 of 4 iterations under the
first layout, saved (--exit-interval 2), then the rest under the second, loaded from that
checkpoint. The report:

  [1/2] per pair: the largest difference of the 4 losses and of the final parameters against
        the uninterrupted single-device run (the book's float64 tolerance: 1e-10 and 1e-9);
  [2/2] per saved layout: the bytes of the tensors its checkpoint holds, against the formula
        N x (e_model + e_main + 2 e_moment) + the vocabulary's padding rows, and the files'
        size on disk (the rest is the index and the pickle's framing);

and ends with a line starting MATCH (exit 0) or MISMATCH (exit 1).
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from booktools.demo import Results
from minimegatron.analysis import count_parameters
from minimegatron.config import ModelConfig, TrainConfig
from minimegatron.dist_checkpoint import load_full_state
from minimegatron.launch import spawn
from minimegatron.tp.layers import pad_vocab_size
from minimegatron.train import train

MODEL = ModelConfig.llama(hidden_size=32, num_layers=4, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=64,
                          vocab_size=257, max_position_embeddings=16, params_dtype="float64")
BASE = TrainConfig(seq_length=16, micro_batch_size=2, grad_accum_steps=4, train_iters=4, lr=1e-2, lr_warmup_iters=0,
                   eval_interval=0, progress=False, ckpt_format="torch_dist")
SIZES = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size", "cp": "context_parallel_size",
         "ep": "expert_model_parallel_size", "v": "num_virtual_stages_per_pipeline_rank", "zero": "zero_stage",
         "sp": "sequence_parallel", "bf16": "bf16"}
# (saved, resumed): every layout has 4 ranks, dp = 4 / (tp cp pp); the global batch stays 8
GRID = [("tp=2 dp=2", "pp=2 dp=2"), ("pp=2 v=2 tp=2", "dp=4 zero=1"), ("dp=4 zero=1", "tp=2 sp dp=2"),
        ("tp=4", "cp=2 tp=2"), ("cp=2 dp=2 zero=2", "dp=4 zero=3"), ("dp=4 zero=3", "pp=4")]
QUICK = GRID[:3]


def layout(spec: str) -> dict:
    """'tp=2 sp dp=2' -> the TrainConfig fields of that layout of 4 ranks (a word without a
    value, sp or bf16, is a switch; chapters/08_capstone/plan_vs_measured.py reads them too)."""
    fields, dp = {}, 1
    for word in spec.split():
        key, _, value = word.partition("=")
        if key == "dp":
            dp = int(value)
        else:
            fields[SIZES[key]] = int(value) if value else True
    if fields.get(SIZES["v"], 1) > 1:
        fields["pipeline_schedule"] = "interleaved"
    return dict(fields, grad_accum_steps=4 // dp)


def train_in_turn(runs: list[tuple[ModelConfig, TrainConfig]]) -> list[list[float]]:
    """Spawn target: train() for each (model, config), in turn, on this world."""
    return [train(model, cfg).losses for model, cfg in runs]


def checkpoint_bytes(path: Path) -> tuple[int, int]:
    """(bytes of the tensors the iteration's files hold, bytes of the files on disk)."""
    tensors = 0
    for file in sorted(path.glob("rank_*.pt")):
        tensors += sum(t.numel() * t.element_size()
                       for t in torch.load(file, weights_only=True, mmap=True)["tensors"].values())
    return tensors, sum(f.stat().st_size for f in path.iterdir())


def formula_bytes(model: ModelConfig, fields: dict) -> int:
    """N x (model + main + two moments) bytes, N counting the padding rows a tp cut adds to the
    vocabulary (saved with the local tensors) of the embedding and of an untied output layer."""
    tp = fields.get(SIZES["tp"], 1)
    vocab_tables = 2 if model.untie_embeddings_and_output_weights else 1
    padding = (pad_vocab_size(model.vocab_size, tp, model.make_vocab_size_divisible_by) - model.vocab_size)
    n = count_parameters(model)["total"] + vocab_tables * padding * model.hidden_size
    e = torch.empty((), dtype=model.dtype).element_size()
    main = 4 if e == 2 else 0                                 # 16-bit models keep float32 main parameters
    moment = 4 if e == 2 else e
    return n * (e + main + 2 * moment)


@dataclasses.dataclass
class ReshardResults(Results):
    pairs: list = dataclasses.field(default_factory=list)        # [1/2] saved, resumed, loss_diff, param_diff
    checkpoints: list = dataclasses.field(default_factory=list)  # [2/2] layout, tensors, formula, disk (bytes)


def main(argv=None) -> ReshardResults:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="three pairs only")
    args = parser.parse_args(argv)
    grid = QUICK if args.quick else GRID
    tmp = Path(tempfile.mkdtemp(prefix="minimegatron-reshard-"))
    cfg = lambda name, spec, **kw: dataclasses.replace(BASE, **layout(spec), **kw, out_dir=str(tmp / "out" / name))  # noqa: E731
    print(f"model: llama, h={MODEL.hidden_size} L={MODEL.num_layers} a={MODEL.num_attention_heads} "
          f"g={MODEL.query_groups} V={MODEL.vocab_size}, float64; 4 iterations of 8 sequences of 16 tokens; "
          f"saved after 2")
    one = train(MODEL, cfg("one", "", save_dir=str(tmp / "one")))
    want = load_full_state(tmp / "one" / "iter_0000004")
    runs = []
    for i, (saved, resumed) in enumerate(grid):
        runs += [(MODEL, cfg(f"a{i}", saved, save_dir=str(tmp / f"a{i}"), exit_interval=2)),
                 (MODEL, cfg(f"b{i}", resumed, load_dir=str(tmp / f"a{i}"), save_dir=str(tmp / f"b{i}")))]
    losses = spawn(train_in_turn, 4, runs, timeout=900)[0]
    print("[1/2] resumed under another layout, against the uninterrupted single-device run:")
    worst, found = 0.0, ReshardResults()
    for i, (saved, resumed) in enumerate(grid):
        got = load_full_state(tmp / f"b{i}" / "iter_0000004")
        dloss = max(abs(a - b) for a, b in zip(losses[2 * i + 1], one.losses))
        dparam = max((got[k] - want[k]).abs().max().item() for k in want)
        worst = max(worst, dloss / 1e-10, dparam / 1e-9)
        found.pairs.append({"saved": saved, "resumed": resumed, "loss_diff": dloss, "param_diff": dparam})
        print(f"  {saved:<18} -> {resumed:<16} loss max |diff| {dloss:.1e}, parameters max |diff| {dparam:.1e}")
    print("[2/2] what a checkpoint holds (iteration 2 of each saved layout), against the formula:")
    exact = True
    for i, (saved, _) in enumerate(grid):
        tensors, disk = checkpoint_bytes(tmp / f"a{i}" / "iter_0000002")
        formula = formula_bytes(MODEL, layout(saved))
        exact &= tensors == formula
        found.checkpoints.append({"layout": saved, "tensors": tensors, "formula": formula, "disk": disk})
        print(f"  {saved:<18} tensors {tensors:,} bytes {'=' if tensors == formula else '!='} formula {formula:,}; "
              f"on disk {disk:,} bytes ({disk / tensors - 1:.1%} more: the index, the checksums and the framing)")
    shutil.rmtree(tmp)                                        # the checkpoints of the grid
    ok = worst <= 1 and exact
    found.exit_code = int(not ok)
    found.verdict = (f"MATCH: {len(grid)} layout pairs resume to the single-device run (largest difference "
                     f"{worst:.2g} x the tolerance); every checkpoint holds the formula's bytes" if ok
                     else "MISMATCH: see above")
    print(found.verdict)
    return found


if __name__ == "__main__":
    sys.exit(main().exit_code)
