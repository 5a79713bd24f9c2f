"""The training loop: schedule, accumulation, learning, exact resume, checkpoints, errors."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minimegatron.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from minimegatron.config import ConfigError, ModelConfig, TrainConfig
from minimegatron.optim import learning_rate
from minimegatron.testing import compare_runs, assert_equivalent, make_batches, single_device_run
from minimegatron.train import main, train

TINY = ModelConfig.llama(hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                         max_position_embeddings=32)


def _train_cfg(tmp_path, **kw):
    base = dict(seq_length=32, micro_batch_size=4, train_iters=8, eval_interval=4, eval_iters=2,
                lr_warmup_iters=2, out_dir=str(tmp_path / "out"), progress=False)
    return TrainConfig(**{**base, **kw})


def test_learning_rate_schedule_by_hand():
    cfg = TrainConfig(lr=1.0, min_lr=0.1, lr_warmup_iters=10, train_iters=110)
    assert learning_rate(0, cfg) == pytest.approx(0.1)          # (0 + 1) / 10 of the peak
    assert learning_rate(9, cfg) == pytest.approx(1.0)          # end of warm-up: the peak
    assert learning_rate(10, cfg) == pytest.approx(1.0)         # cosine starts at the peak
    assert learning_rate(60, cfg) == pytest.approx(0.55)        # half way: (max + min) / 2
    assert learning_rate(110, cfg) == pytest.approx(0.1)        # the end: min_lr
    decay = [learning_rate(s, cfg) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(decay, decay[1:]))


def test_gradient_accumulation_equals_one_large_batch():
    """4 micro-batches of 2 sequences == 1 batch of 8, in float64 (the harness's own check)."""
    cfg = ModelConfig(**{**TINY.__dict__, "params_dtype": "float64"})
    batches = make_batches(cfg, steps=3, batch_size=8, seq_length=16)
    one = single_device_run(cfg, batches, grad_accum_steps=1)
    four = single_device_run(cfg, batches, grad_accum_steps=4)
    report = assert_equivalent(one, four, torch.float64)
    assert report.max_loss_diff < 1e-12
    # The harness can fail: a run on other data is reported as a mismatch, by name.
    other = single_device_run(cfg, make_batches(cfg, steps=3, batch_size=8, seq_length=16, seed=1))
    bad = compare_runs(one, other, torch.float64)
    assert not bad.ok and "MISMATCH" in str(bad)
    # ...and so is a gradient accumulation that forgets to divide by the number of micro-batches.
    wrong = single_device_run(cfg, batches[:1], grad_accum_steps=4)
    wrong.grads = {k: v * 4 for k, v in wrong.grads.items()}
    assert not compare_runs(single_device_run(cfg, batches[:1]), wrong, torch.float64).ok


def test_train_step_on_one_device_is_adamw_with_torch_clipping():
    """train.train_step on Layout() (the step of every layout, here all sizes 1) against the
    step written with torch alone: micro-batch losses / M, backward, torch's
    clip_grad_norm_, AdamW with decay on matrices only. Clipping is active (max norm far
    below the gradient norm), float64, three steps with the warm-up and cosine schedule."""
    from minimegatron.model import GPTModel
    from minimegatron.optim import Optimizer
    from minimegatron.parallel_state import Layout
    from minimegatron.testing import TOLERANCES, split_microbatches
    from minimegatron.train import train_step

    cfg = ModelConfig(**{**TINY.__dict__, "params_dtype": "float64"})
    tcfg = TrainConfig(train_iters=3, lr_warmup_iters=1, clip_grad=0.05, lr=1e-2, min_lr=1e-3)
    batches = make_batches(cfg, steps=3, batch_size=4, seq_length=16)

    ours = GPTModel(cfg)
    optimizer = Optimizer([ours], tcfg)
    ref = GPTModel(cfg)
    params = list(ref.parameters())
    ref_opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": tcfg.weight_decay},
                                 {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                                lr=tcfg.lr, betas=(tcfg.adam_beta1, tcfg.adam_beta2), eps=tcfg.adam_eps)
    for step, batch in enumerate(batches):
        lr = learning_rate(step, tcfg)
        microbatches = split_microbatches(batch, 2)
        loss, norm = train_step([ours], optimizer, microbatches, Layout(), lr)

        ref_loss = 0.0
        for mb in microbatches:
            part = ref(mb["tokens"], labels=mb["labels"]).mean() / len(microbatches)
            part.backward()
            ref_loss += part.item()
        ref_norm = torch.nn.utils.clip_grad_norm_(params, tcfg.clip_grad).item()
        for group in ref_opt.param_groups:
            group["lr"] = lr
        ref_opt.step()
        ref_opt.zero_grad()

        assert ref_norm > 10 * tcfg.clip_grad                           # clipping does something
        assert loss == pytest.approx(ref_loss, rel=0, abs=TOLERANCES[torch.float64].loss)
        assert norm == pytest.approx(ref_norm, rel=1e-12)
    tol = TOLERANCES[torch.float64]
    for (name, a), b in zip(ours.named_parameters(), params):
        torch.testing.assert_close(a, b, rtol=tol.rtol, atol=tol.atol, msg=name)


def test_loss_goes_down_on_the_embedded_corpus(tmp_path):
    result = train(TINY, _train_cfg(tmp_path, train_iters=40, lr=3e-3, eval_interval=20))
    first, last = sum(result.losses[:5]) / 5, sum(result.losses[-5:]) / 5
    assert result.losses[0] == pytest.approx(math.log(TINY.vocab_size), abs=0.1)  # uniform at init
    assert last < first - 1.0, (first, last)
    assert (tmp_path / "out" / "loss.png").stat().st_size > 1000
    logged = json.loads((tmp_path / "out" / "losses.json").read_text())
    assert logged["train"] == result.losses and len(logged["eval"]) == 2


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_exact_resume_is_bit_identical(tmp_path, grad_accum):
    """Stop at step 4, resume to 8: the same losses, bit for bit (dropout on: RNG is restored)."""
    model_cfg = ModelConfig(**{**TINY.__dict__, "hidden_dropout": 0.1, "attention_dropout": 0.1})
    full = train(model_cfg, _train_cfg(tmp_path / "a", grad_accum_steps=grad_accum))
    ckpt = tmp_path / "ckpt"
    train(model_cfg, _train_cfg(tmp_path / "b", grad_accum_steps=grad_accum, train_iters=8,
                                save_dir=str(ckpt), save_interval=4))
    # Throw away the final checkpoint: resume from step 4 only.
    (ckpt / "iter_0000008.pt").unlink()
    (ckpt / "latest").write_text("iter_0000004.pt\n")
    resumed = train(model_cfg, _train_cfg(tmp_path / "c", grad_accum_steps=grad_accum, load_dir=str(ckpt)))
    assert resumed.losses == full.losses
    assert resumed.eval_losses == full.eval_losses


def test_checkpoint_from_another_model_is_refused(tmp_path):
    train(TINY, _train_cfg(tmp_path, train_iters=2, save_dir=str(tmp_path / "ckpt")))
    bigger = ModelConfig(**{**TINY.__dict__, "hidden_size": 64})
    with pytest.raises(CheckpointError, match="hidden_size: checkpoint 32, run 64"):
        train(bigger, _train_cfg(tmp_path, train_iters=4, load_dir=str(tmp_path / "ckpt")))


def test_resuming_with_another_training_config_is_refused(tmp_path):
    """Another batch size or data seed would silently change the run: refused, by field."""
    train(TINY, _train_cfg(tmp_path, train_iters=2, save_dir=str(tmp_path / "ckpt")))
    with pytest.raises(CheckpointError, match="micro_batch_size: checkpoint 4, run 2"):
        train(TINY, _train_cfg(tmp_path, train_iters=2, micro_batch_size=2, load_dir=str(tmp_path / "ckpt")))


def test_corrupt_checkpoint_is_a_clear_error(tmp_path):
    path = save_checkpoint(tmp_path, 1, {"model": {"w": torch.ones(3)}})
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        load_checkpoint(tmp_path)


def test_a_crash_while_saving_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 1, {"model": {"w": torch.ones(3)}})

    def crash(obj, f, *a, **k):
        Path(f).write_bytes(b"half a file")
        raise KeyboardInterrupt("power cut")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 2, {"model": {"w": torch.zeros(3)}})
    monkeypatch.undo()
    state = load_checkpoint(tmp_path)
    assert state["step"] == 1 and torch.equal(state["model"]["w"], torch.ones(3))


def test_the_next_save_removes_what_a_killed_save_left(tmp_path, monkeypatch):
    """A save killed between writing its temporary file and renaming it leaves *.tmp behind;
    the next save in that directory removes it (and keeps the checkpoints)."""
    save_checkpoint(tmp_path, 1, {"model": {"w": torch.ones(3)}})

    def killed(obj, f, *a, **k):
        Path(f).write_bytes(b"half a file")
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(torch, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 2, {"model": {"w": torch.zeros(3)}})
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.glob("*.tmp")) == ["iter_0000002.pt.tmp"]
    save_checkpoint(tmp_path, 3, {"model": {"w": torch.full((3,), 3.0)}})
    assert not list(tmp_path.glob("*.tmp"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000001.pt", "iter_0000003.pt", "latest"]
    assert load_checkpoint(tmp_path)["step"] == 3


@pytest.mark.parametrize("kind, words", [("missing", "does not exist"), ("file", "is a file"),
                                         ("empty dir", "holds no `latest` file")])
def test_a_load_dir_without_a_checkpoint_warns_and_trains_from_scratch(tmp_path, kind, words):
    """As Megatron's --load ("could not find the metadata file ... will start from random"):
    a visible warning, then the run of a fresh start."""
    load = tmp_path / "ckpt"
    if kind == "file":
        load.write_text("not a directory")
    elif kind == "empty dir":
        load.mkdir()
    with pytest.warns(UserWarning, match=f"load_dir {load} {words}.*training starts from scratch"):
        resumed = train(TINY, _train_cfg(tmp_path / "a", train_iters=2, eval_interval=0, load_dir=str(load)))
    fresh = train(TINY, _train_cfg(tmp_path / "b", train_iters=2, eval_interval=0))
    assert resumed.losses == fresh.losses


def test_an_empty_latest_file_is_a_clear_error(tmp_path):
    save_checkpoint(tmp_path, 1, {"model": {"w": torch.ones(3)}})
    (tmp_path / "latest").write_text("\n")
    with pytest.raises(CheckpointError, match=r"latest is empty: it should name the newest checkpoint file"):
        train(TINY, _train_cfg(tmp_path / "run", train_iters=2, load_dir=str(tmp_path)))
    with pytest.raises(CheckpointError, match=r"latest is empty"):
        load_checkpoint(tmp_path)
    (tmp_path / "latest").write_text("iter_0000009.pt\n")
    with pytest.raises(CheckpointError, match=r"names iter_0000009.pt, which does not exist"):
        load_checkpoint(tmp_path)


def test_checkpoints_load_without_pickled_code(tmp_path):
    """A file that would run code when unpickled is refused, not executed."""
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    path = tmp_path / "iter_0000001.pt"
    torch.save({"format": "minimegatron-checkpoint-v1", "payload": Evil()}, path)
    with pytest.raises(CheckpointError):
        load_checkpoint(path)


@pytest.mark.parametrize("argv, words", [
    (["--hidden-size", "30", "--num-attention-heads", "4"], ["hidden_size=30", "num_attention_heads=4"]),
    (["--seq-length", "64", "--max-position-embeddings", "32"], ["seq_length=64", "max_position_embeddings=32"]),
    (["--data-path", "/nonexistent/corpus"], ["/nonexistent/corpus"]),
    (["--lr-warmup-iters", "100", "--train-iters", "10"], ["lr_warmup_iters=100", "train_iters=10"]),
])
def test_bad_command_lines_stop_before_training_and_name_the_field(argv, words, capsys, tmp_path):
    assert main(argv + ["--out-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err
    assert not (tmp_path / "loss.png").exists()


def test_command_line_run_writes_the_plot(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "minimegatron.train", "--preset", "tiny", "--train-iters", "3",
                           "--eval-interval", "3", "--lr-warmup-iters", "1", "--out-dir", str(out)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "final train loss" in proc.stdout
    assert (out / "loss.png").exists()


# ---------------------------------------------------------------------- a hung rank
def _one_rank_hangs_before_a_tp_all_reduce(hang_s: float) -> None:
    """Rank 1 sleeps (a hung rank) while rank 0 enters an all-reduce on the TP subgroup."""
    import time

    import torch.distributed as dist

    from minimegatron import parallel_state
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)      # as train does: no timeout given
    if dist.get_rank() == 1:
        time.sleep(hang_s)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=parallel_state.get_tensor_model_parallel_group())
    except RuntimeError as exc:          # say how long rank 0 waited (start-up time not counted)
        raise RuntimeError(f"waited {time.monotonic() - start:.1f} s: {exc}") from None


def test_a_hung_rank_ends_the_job_with_a_timed_out_error_within_the_world_timeout():
    """Every subgroup gets the world group's timeout (here 3 s), not torch's 30 minutes: rank
    0 waits 3 s for rank 1 (asleep for 90 s) and fails with a "timed out" error. Were the TP
    group on torch's default, rank 0 would wait for rank 1 and the job would end after 90 s
    without an error. Rank 0 reports how long it waited, which excludes the start-up time of
    two Pythons on a loaded machine."""
    import re

    from minimegatron.launch import spawn
    with pytest.raises(Exception, match="(?i)timed out") as info:
        spawn(_one_rank_hangs_before_a_tp_all_reduce, 2, 90.0, timeout=120.0, collective_timeout=3.0)
    waited = float(re.search(r"waited ([0-9.]+) s", str(info.value)).group(1))
    assert 2.5 < waited < 20.0, f"rank 0 waited {waited} s for a collective with a 3 s timeout: {info.value}"
