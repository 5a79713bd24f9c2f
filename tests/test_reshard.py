"""Chapter 08: checkpoints that reshard (--ckpt-format torch_dist, dist_checkpoint.py). A run
saved after 2 of its 4 iterations under one layout resumes under another, with the training
command's own train(), and ends where the uninterrupted single-device run ends: the same
losses and final parameters within float64 summation order (bf16 runs: within bf16's). Every
dimension changes somewhere in the grid (tp, sp, cp, pp with and without interleaving, ep,
etp, dp), as do the ZeRO stage (0 to 3) and the precision (float32 <-> bf16); 4-rank layouts
run in one spawned world, 1-rank ones in this process."""

import dataclasses
import shutil

import pytest
import torch

from minimegatron.checkpoint import with_checksums
from minimegatron.config import ModelConfig, TrainConfig
from minimegatron.dist_checkpoint import load_full_state
from minimegatron.launch import spawn
from minimegatron.train import train
from tests.workers import reshard as W

DENSE = ModelConfig.llama(hidden_size=32, num_layers=4, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=64,
                          vocab_size=257, max_position_embeddings=16, params_dtype="float64")   # the byte tokenizer
MOE = dataclasses.replace(DENSE, num_experts=4, moe_router_topk=2)
# the global batch stays 8 sequences whatever dp is: micro 2 x accum x dp
BASE = TrainConfig(seq_length=16, micro_batch_size=2, grad_accum_steps=4, train_iters=4, lr=1e-2, lr_warmup_iters=0,
                   eval_interval=0, progress=False, ckpt_format="torch_dist", out_dir="unused")


def layout(dp=1, **sizes) -> dict:
    fields = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size", "cp": "context_parallel_size",
              "ep": "expert_model_parallel_size", "etp": "expert_tensor_parallel_size", "v":
              "num_virtual_stages_per_pipeline_rank", "zero": "zero_stage", "sp": "sequence_parallel"}
    out = {fields[k]: v for k, v in sizes.items()}
    if sizes.get("v", 1) > 1:
        out["pipeline_schedule"] = "interleaved"
    return dict(out, grad_accum_steps=4 // dp)


# (name, model, layout saved, layout resumed); every layout but ONE has 4 ranks (dp = 4 / the rest)
PAIRS = [
    ("tp2 x dp2 -> pp2 x dp2", DENSE, layout(tp=2, dp=2), layout(pp=2, dp=2)),
    ("pp2 x 2 chunks x tp2 -> dp4 ZeRO-1", DENSE, layout(pp=2, v=2, tp=2), layout(dp=4, zero=1)),
    ("dp4 ZeRO-1 -> tp2 + SP x dp2", DENSE, layout(dp=4, zero=1), layout(tp=2, sp=True, dp=2)),
    ("tp4 -> cp2 x tp2", DENSE, layout(tp=4), layout(cp=2, tp=2)),
    ("cp2 x dp2 ZeRO-2 -> dp4 ZeRO-3", DENSE, layout(cp=2, dp=2, zero=2), layout(dp=4, zero=3)),
    ("dp4 ZeRO-3 -> pp4", DENSE, layout(dp=4, zero=3), layout(pp=4)),
    ("pp2 x dp2 ZeRO-1 -> pp2 x 2 chunks x dp2", DENSE, layout(pp=2, dp=2, zero=1), layout(pp=2, v=2, dp=2)),
    ("ep4 -> ep2 x etp2 (tp2 + SP)", MOE, layout(ep=4, dp=4), layout(ep=2, etp=2, tp=2, sp=True, dp=2)),
    ("ep2 x etp2 (tp2 + SP) -> tp2 + SP x pp2, ep1", MOE, layout(ep=2, etp=2, tp=2, sp=True, dp=2),
     layout(tp=2, sp=True, pp=2)),
    ("ep2 x dp4 ZeRO-1 -> ep4 x dp4", MOE, layout(ep=2, dp=4, zero=1), layout(ep=4, dp=4)),
]
# and across the process count: one device -> 4 ranks, 4 ranks -> one device
ONE_TO_FOUR = ("one device -> tp2 x pp2", DENSE, layout(), layout(tp=2, pp=2))
FOUR_TO_ONE = ("tp2 x dp2 ZeRO-1 -> one device", DENSE, layout(tp=2, dp=2, zero=1), layout())
# precision: bf16 <-> float32 (the bf16 run keeps float32 main parameters, which a float32 resume reads)
BF16 = dict(bf16=True)
PRECISION = [("bf16 tp2 x dp2 -> float32 pp2 x dp2", layout(tp=2, dp=2) | BF16, layout(pp=2, dp=2)),
             ("float32 dp4 ZeRO-1 -> bf16 tp4", layout(dp=4, zero=1), layout(tp=4) | BF16)]


# FP8 delayed scaling: its scales and amax histories travel. Saved under tp2 + SP x pp2, resumed
# under tp4 + SP, and on one device (tp and pp keep one device's amaxes: the book reduces them
# over tp x cp; data-parallel replicas and cp ranks would not see one device's, chapter 06 §5)
FP8 = dict(fp8_format="hybrid", fp8_recipe="delayed", fp8_amax_history_len=4, fp8_amax_compute_algo="max")
FP8_PAIR = ("fp8 delayed tp2 + SP x pp2 -> tp4 + SP", layout(tp=2, sp=True, pp=2) | FP8, layout(tp=4, sp=True) | FP8)


def _cfg(tmp, name, fields, **kw) -> TrainConfig:
    return dataclasses.replace(BASE, **fields, **kw, out_dir=str(tmp / "out" / name))


def _model(model, fields):
    return dataclasses.replace(model, params_dtype="bfloat16" if fields.get("bf16") else
                               "float32" if model is FLOAT32 else model.params_dtype)


FLOAT32 = dataclasses.replace(DENSE, params_dtype="float32")


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reshard")
    runs, one = [], {}
    # the uninterrupted single-device runs, saved at the end
    for key, model in (("dense", DENSE), ("moe", MOE)):
        one[key] = (train(model, _cfg(tmp, f"one-{key}", layout(), save_dir=str(tmp / f"one-{key}"))).losses,
                    load_full_state(tmp / f"one-{key}" / "iter_0000004"))
    # precision: the single-device reference takes the same switch at the same iteration
    for i, (name, saved, resumed) in enumerate(PRECISION):
        first, second = ({"bf16": True}, {}) if saved.get("bf16") else ({}, {"bf16": True})
        path = tmp / f"prec-one-{i}"
        train(_model(FLOAT32, first), _cfg(tmp, f"p1-{i}", layout() | first, save_dir=str(path), exit_interval=2))
        losses = train(_model(FLOAT32, second), _cfg(tmp, f"p2-{i}", layout() | second, load_dir=str(path),
                                                     save_dir=str(path))).losses
        one[f"precision-{i}"] = (losses, load_full_state(path / "iter_0000004"))
    # the first halves that start on one device
    name, model, saved, resumed = ONE_TO_FOUR
    train(model, _cfg(tmp, "a-one", saved, save_dir=str(tmp / "a-one"), exit_interval=2))
    for i, (name, model, saved, resumed) in enumerate(PAIRS):
        runs += [(model, _cfg(tmp, f"a{i}", saved, save_dir=str(tmp / f"a{i}"), exit_interval=2)),
                 (model, _cfg(tmp, f"b{i}", resumed, load_dir=str(tmp / f"a{i}"), save_dir=str(tmp / f"b{i}")))]
    runs.append((DENSE, _cfg(tmp, "b-one", ONE_TO_FOUR[3], load_dir=str(tmp / "a-one"), save_dir=str(tmp / "b-one"))))
    runs.append((DENSE, _cfg(tmp, "a-four", FOUR_TO_ONE[2], save_dir=str(tmp / "a-four"), exit_interval=2)))
    for i, (name, saved, resumed) in enumerate(PRECISION):
        runs += [(_model(FLOAT32, saved), _cfg(tmp, f"pa{i}", saved, save_dir=str(tmp / f"pa{i}"), exit_interval=2)),
                 (_model(FLOAT32, resumed), _cfg(tmp, f"pb{i}", resumed, load_dir=str(tmp / f"pa{i}"),
                                                 save_dir=str(tmp / f"pb{i}")))]
    runs += [(DENSE, _cfg(tmp, "fa", FP8_PAIR[1], save_dir=str(tmp / "fa"), exit_interval=2)),
             (DENSE, _cfg(tmp, "fb", FP8_PAIR[2], load_dir=str(tmp / "fa"), save_dir=str(tmp / "fb")))]
    one["fp8"] = train(DENSE, _cfg(tmp, "one-fp8", FP8)).losses
    losses = spawn(W.train_in_turn, 4, runs, timeout=900)[0]
    # the last pair's second half on one device
    four_to_one = train(DENSE, _cfg(tmp, "b-four", FOUR_TO_ONE[3], load_dir=str(tmp / "a-four"),
                                    save_dir=str(tmp / "b-four"))).losses
    return tmp, one, losses, four_to_one


def _compare(got_losses, got_state, want_losses, want_state, loss_tol, tol):
    assert len(got_losses) == len(want_losses) == 4
    assert max(abs(a - b) for a, b in zip(got_losses, want_losses)) < loss_tol, (got_losses, want_losses)
    assert set(got_state) == set(want_state)
    for name, want in want_state.items():
        torch.testing.assert_close(got_state[name].double(), want.double(), rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize("index", range(len(PAIRS)), ids=[p[0] for p in PAIRS])
def test_a_run_saved_under_one_layout_resumes_under_another(grid, index):
    tmp, one, losses, _ = grid
    name, model, saved, resumed = PAIRS[index]
    want_losses, want_state = one["moe" if model is MOE else "dense"]
    _compare(losses[2 * index + 1], load_full_state(tmp / f"b{index}" / "iter_0000004"), want_losses, want_state,
             1e-10, 1e-9)


def test_one_device_to_four_ranks_and_back(grid):
    tmp, one, losses, four_to_one = grid
    want_losses, want_state = one["dense"]
    _compare(losses[2 * len(PAIRS)], load_full_state(tmp / "b-one" / "iter_0000004"), want_losses, want_state,
             1e-10, 1e-9)
    _compare(four_to_one, load_full_state(tmp / "b-four" / "iter_0000004"), want_losses, want_state, 1e-10, 1e-9)


@pytest.mark.parametrize("index", range(len(PRECISION)), ids=[p[0] for p in PRECISION])
def test_the_precision_changes_at_the_resume_as_on_one_device(grid, index):
    tmp, one, losses, _ = grid
    want_losses, want_state = one[f"precision-{index}"]
    got = losses[2 * len(PAIRS) + 2 + 2 * index + 1]
    _compare(got, load_full_state(tmp / f"pb{index}" / "iter_0000004"), want_losses, want_state, 2e-2, 5e-2)


def test_fp8_delayed_scaling_resumes_under_another_layout_and_on_one_device(grid, tmp_path):
    """The scales and amax histories (kind "fp8") come back: the resumed FP8 runs equal the
    uninterrupted one-device run; the same checkpoint without them (its "fp8" pieces dropped
    from the index: every layer starts again from scale 1) does not."""
    tmp, one, losses, _ = grid
    want = one["fp8"]
    got = losses[-1]
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-10, (got, want)
    on_one = train(DENSE, _cfg(tmp, "fc", FP8, load_dir=str(tmp / "fa"))).losses
    assert max(abs(a - b) for a, b in zip(on_one, want)) < 1e-10, (on_one, want)
    bare = tmp_path / "bare"
    shutil.copytree(tmp / "fa", bare)
    common = bare / "iter_0000002" / "common.pt"
    state = torch.load(common, weights_only=True)
    assert any(d["kind"] == "fp8" for d in state["index"])
    edited = dict(state, index=[d for d in state["index"] if d["kind"] != "fp8"])
    torch.save(with_checksums(edited), common)                        # an edit that means it: new checksums
    fresh = train(DENSE, _cfg(tmp, "fd", FP8, load_dir=str(bare))).losses
    assert abs(fresh[2] - want[2]) > 1e-6, (fresh, want)


def test_fp8_delayed_scaling_resumes_from_the_torch_format():
    """Chapter 00's format keeps each rank's FP8 state in its own file (the same layout resumes)."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        cfg = dataclasses.replace(BASE, **FP8, ckpt_format="torch", out_dir=f"{tmp}/out")
        want = train(DENSE, cfg).losses
        train(DENSE, dataclasses.replace(cfg, save_dir=f"{tmp}/ckpt", exit_interval=2))
        got = train(DENSE, dataclasses.replace(cfg, load_dir=f"{tmp}/ckpt")).losses
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-10, (got, want)
