"""What the reliability review of issue 20 (§5) found in the training entry, each case now
refused or named: infinite and too-large values, a loss that turns non-finite, a run
extended with a larger --train-iters, a bad per-rank checkpoint file, a hung rank, a killed
torchrun, two runs writing one save directory, and errors printed once per job.

The multi-rank cases run `python -m torch.distributed.run` on tests/workers/reliability.py
(train.main with a fault injected), as a user runs the entry, with a 10 s collective timeout;
each asserts the job ends within 15 s of its fault, naming the rank or the file. Times are
hang detectors, not speed tests.
"""

import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from minimegatron.checkpoint import (CheckpointError, load_checkpoint, load_rank_state, lock_save_dir, rank_path,
                                     save_checkpoint)
from minimegatron.config import ConfigError, ModelConfig, TrainConfig, to_dict
from minimegatron.nonfinite import NonFiniteError
from minimegatron.parallel_state import Layout
from minimegatron.resume import open_checkpoint
from minimegatron.train import main, train
from minimegatron.watchdog import STALE_AFTER, did_not_arrive
from workers import reliability as worker  # tests/workers/reliability.py

TINY = ModelConfig.llama(hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                         max_position_embeddings=32)
WORKER = Path(worker.__file__)
TIMEOUT_10_S = ["--distributed-timeout-minutes", str(10 / 60)]
FLOAT32_MAX = 3.4028234663852886e38            # the largest float32, (2 - 2^-23) x 2^127


def _cfg(tmp_path, **kw) -> TrainConfig:
    base = dict(seq_length=32, micro_batch_size=4, train_iters=4, eval_interval=0, lr_warmup_iters=0,
                out_dir=str(tmp_path / "out"), progress=False)
    return TrainConfig(**{**base, **kw})


# ---------------------------------------------------------------------------------------
# 1. values that cannot train
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, field", [
    (["--lr", "inf"], "lr=inf"),
    (["--lr", "nan"], "lr=nan"),
    (["--min-lr=-inf"], "min_lr=-inf"),
    (["--clip-grad", "inf"], "clip_grad=inf"),
    (["--weight-decay", "inf"], "weight_decay=inf"),
    (["--num-experts", "4", "--moe-aux-loss-coeff", "inf"], "moe_aux_loss_coeff=inf"),
    (["--num-experts", "4", "--moe-z-loss-coeff", "inf"], "moe_z_loss_coeff=inf"),
    (["--num-experts", "4", "--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid",
      "--moe-router-bias-update-rate", "inf"], "moe_router_bias_update_rate=inf"),
    (["--num-experts", "4", "--moe-expert-capacity-factor", "inf"], "moe_expert_capacity_factor=inf"),
    (["--rotary-base", "inf"], "rotary_base=inf"),
    (["--distributed-timeout-minutes", "inf"], "distributed_timeout_minutes=inf"),
])
def test_infinite_values_are_refused_by_field_before_training(argv, field, capsys, tmp_path):
    """Each used to train to NaN and exit 0, be accepted, or raise OverflowError in the router."""
    assert main(argv + ["--out-dir", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and field in err and "Traceback" not in err, err
    assert "finite" in err, err
    assert not (tmp_path / "loss.png").exists()


def test_every_float_field_is_checked_for_finiteness():
    """Not only the flags above: every float field of both configs, inf and nan, by name."""
    import dataclasses
    for cls, make in ((ModelConfig, lambda **kw: ModelConfig(num_experts=4, **kw)),
                      (TrainConfig, lambda **kw: TrainConfig(**kw))):
        floats = [f.name for f in dataclasses.fields(cls) if "float" in str(f.type)]
        assert len(floats) >= 6, floats
        for name in floats:
            for bad in (math.inf, -math.inf, math.nan):
                with pytest.raises(ConfigError, match=f"^{name}={bad} must be a finite number"):
                    make(**{name: bad}).validate()


def test_the_largest_learning_rate_is_the_one_adamw_can_take():
    """--lr 1e308 --min-lr 0 ended in torch AdamW's RuntimeError. The bound is AdamW's own: its
    first step size lr / (1 - beta1) must fit in float32 (for float32 and bfloat16 parameters).
    Checked against AdamW itself: just below the bound its first step runs, just above it
    raises, and validation refuses exactly the second."""
    def adamw_first_step(lr, beta1, dtype):
        p = torch.nn.Parameter(torch.ones(2, dtype=dtype))
        p.grad = torch.ones(2, dtype=dtype)
        try:
            torch.optim.AdamW([p], lr=lr, betas=(beta1, 0.95)).step()
            return True
        except RuntimeError:
            return False

    for beta1 in (0.9, 0.0):
        for params_dtype, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            model = ModelConfig(params_dtype=params_dtype)
            for factor, runs in ((0.999, True), (1.001, False)):
                lr = FLOAT32_MAX * (1 - beta1) * factor
                assert adamw_first_step(lr, beta1, dtype) is runs, (beta1, params_dtype, factor)
                cfg = TrainConfig(lr=lr, min_lr=0.0, adam_beta1=beta1)
                if runs:
                    cfg.validate(model)
                else:
                    with pytest.raises(ConfigError, match=r"lr=.* is too large for AdamW.*3\.4e\+38"):
                        cfg.validate(model)


def test_lr_1e308_is_refused_naming_the_bound(capsys, tmp_path):
    assert main(["--lr", "1e308", "--min-lr", "0", "--out-dir", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "lr=1e+308 is too large for AdamW" in err and "adam_beta1=0.9" in err and "3.4e+38" in err, err
    assert "Traceback" not in err


# ---------------------------------------------------------------------------------------
# 2. the loop stops at a non-finite loss; a loss scaler's skipped step is no error
# ---------------------------------------------------------------------------------------
def test_a_non_finite_loss_stops_the_run_naming_the_iteration(tmp_path, capsys):
    """lr 1e30 (below AdamW's bound): iteration 1 runs from the initial weights (a finite loss
    and norm); AdamW's first step moves each weight by about lr, so in iteration 2 products of
    two weights (1e60) overflow float32 (3.4e38), and its loss or gradient norm is not finite.
    The run stops there, before saving iteration 2; it used to train on and exit 0."""
    ckpt = tmp_path / "ckpt"
    with pytest.raises(NonFiniteError, match=r"^iteration 2: the (loss|gradient norm) is (nan|inf)") as info:
        train(TINY, _cfg(tmp_path, lr=1e30, min_lr=1e30, save_dir=str(ckpt), save_interval=1))
    assert "1e+30" in str(info.value)
    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0000001.pt"]
    assert main(["--lr", "1e30", "--min-lr", "1e30", "--lr-warmup-iters", "0", "--train-iters", "3",
                 "--out-dir", str(tmp_path / "cli"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert re.match(r"error: iteration 2: the (loss|gradient norm) is (nan|inf)", err), err


class _BackingOffScaler:
    """A dynamic loss scaler: starts at 2^200 (every float32 gradient overflows), halves its
    exponent after a step with inf/nan gradients."""

    def __init__(self):
        self.scale, self.found = 2.0 ** 200, []

    def update(self, found_inf: bool) -> None:
        self.found.append(found_inf)
        if found_inf:
            self.scale = 2.0 ** (math.log2(self.scale) / 2)


def test_a_step_the_loss_scaler_skips_is_no_error(tmp_path, monkeypatch):
    """With a loss scaler, inf or nan in the scaled gradients is its signal. Iteration 1 here
    has a finite loss whose gradients, scaled by 2^200, overflow float32; the scaler skips the
    step (no norm), which is no error, halves its exponent, and the run trains on. (A
    non-finite loss is no such signal, with a scaler too: tests/test_bad_input.py.)"""
    import minimegatron.train as train_module
    from minimegatron.optim import Optimizer

    scalers = []

    def build_optimizer(chunks, cfg, layout):
        scalers.append(_BackingOffScaler())
        return Optimizer(chunks, cfg, grad_scaler=scalers[-1])

    monkeypatch.setattr(train_module, "build_optimizer", build_optimizer)
    result = train(TINY, _cfg(tmp_path))
    assert scalers[0].found == [True, False, False, False], scalers[0].found
    assert all(math.isfinite(x) for x in result.losses), result.losses
    assert result.skipped_steps == 1


# ---------------------------------------------------------------------------------------
# 6. a run extended with a larger --train-iters; the step a resume loaded
# ---------------------------------------------------------------------------------------
def test_a_run_is_extended_with_a_larger_train_iters(tmp_path, capsys):
    """With a constant learning rate (lr = min_lr, no warm-up) the schedule does not depend on
    train_iters, so 8 iterations stopped at 4 and resumed with --train-iters 12 must repeat
    an uninterrupted 12-iteration run bit for bit: the data order, the state and the history
    carry over. The resume says which iteration it loaded."""
    const = dict(lr=1e-3, min_lr=1e-3)
    full = train(TINY, _cfg(tmp_path / "a", train_iters=12, **const))
    ckpt = tmp_path / "ckpt"
    train(TINY, _cfg(tmp_path / "b", train_iters=8, save_dir=str(ckpt), save_interval=4, **const))
    (ckpt / "latest").write_text("iter_0000004.pt\n")
    capsys.readouterr()
    extended = train(TINY, _cfg(tmp_path / "c", train_iters=12, load_dir=str(ckpt), **const))
    assert extended.losses == full.losses
    out = capsys.readouterr().out
    assert f"resumed from {ckpt / 'iter_0000004.pt'}: 4 of the checkpoint's 8 iterations done; training " \
           f"iterations 5 to 12" in out, out
    assert "train_iters=12 (checkpoint: 8)" in out and "--override-opt-param-scheduler" in out, out


def test_the_extended_schedule_is_recomputed_and_said(tmp_path, capsys):
    """A cosine schedule: resumed after 4 of 8 iterations with --train-iters 12, iteration 5
    takes the lr of the 12-iteration cosine, printed beside the 8-iteration one's (both by
    hand here: warm-up 2, then min + (max - min) (1 + cos(pi p)) / 2, p = (4 - 2) / (T - 2))."""
    sched = dict(lr=1e-2, min_lr=1e-3, lr_warmup_iters=2)
    ckpt = tmp_path / "ckpt"
    train(TINY, _cfg(tmp_path / "b", train_iters=8, save_dir=str(ckpt), save_interval=4, **sched))
    (ckpt / "latest").write_text("iter_0000004.pt\n")
    capsys.readouterr()
    resumed = train(TINY, _cfg(tmp_path / "c", train_iters=12, load_dir=str(ckpt), **sched))
    assert len(resumed.losses) == 12
    out = capsys.readouterr().out

    def cosine(total):
        return 1e-3 + 0.5 * (1e-2 - 1e-3) * (1 + math.cos(math.pi * (4 - 2) / (total - 2)))

    assert f"iteration 5 takes lr {cosine(12):.3g}, where the checkpoint's schedule gave {cosine(8):.3g}" in out, out
    with pytest.raises(CheckpointError, match=r"train_iters=3 is below the 8 iterations .* --train-iters 8 or more"):
        train(TINY, _cfg(tmp_path / "d", train_iters=3, load_dir=str(_finished(ckpt)), **sched))


def _finished(ckpt: Path) -> Path:
    """`ckpt` pointed back at its last checkpoint (8 iterations done)."""
    (ckpt / "latest").write_text("iter_0000008.pt\n")
    return ckpt


def test_a_resume_with_another_training_config_names_the_flag(tmp_path):
    train(TINY, _cfg(tmp_path, train_iters=2, save_dir=str(tmp_path / "ckpt")))
    with pytest.raises(CheckpointError, match=r"micro_batch_size: checkpoint 4, run 2 \(to resume, give the "
                                              r"checkpoint's values: --micro-batch-size 4\)"):
        train(TINY, _cfg(tmp_path, train_iters=4, micro_batch_size=2, load_dir=str(tmp_path / "ckpt")))


# ---------------------------------------------------------------------------------------
# 3 (on one process), 7: unreadable files and the layout refusal's words
# ---------------------------------------------------------------------------------------
def test_a_zero_byte_checkpoint_names_the_file_and_why(tmp_path):
    """torch.load of an empty file raises with an empty message: the error said nothing."""
    path = save_checkpoint(tmp_path, 1, {"model": {"w": torch.ones(3)}})
    path.write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"cannot read checkpoint .*iter_0000001.pt: the file is empty \(0 bytes\)"):
        load_checkpoint(tmp_path)
    rank_path(tmp_path, 1, 3).write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"iter_0000001.rank3.pt: the file is empty"):
        load_rank_state(tmp_path, 1, 3)
    rank_path(tmp_path, 1, 3).write_bytes(b"PK\x03\x04 half a zip")
    with pytest.raises(CheckpointError, match=r"rank3.pt: \w+: .+ \(the file has 15 bytes"):
        load_rank_state(tmp_path, 1, 3)


def test_the_layout_refusal_counts_data_parallel_ranks_as_the_banner(tmp_path):
    """A 4-rank run of cp 2 has 2 data-parallel replicas (the banner's "data-parallel size 2",
    Megatron's dp); the refusal used to say dp_size=4 (cp_size=2)."""
    cfg = _cfg(tmp_path, load_dir=str(tmp_path))
    save_checkpoint(tmp_path, 2, {"model_config": to_dict(TINY), "train_config": to_dict(cfg), "tp_size": 1,
                                  "pp_size": 1, "cp_size": 2, "dp_size": 4})
    this_run = Layout(world=4, dp=4, cp=4)                 # cp 4: one replica of 4 ranks
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(TINY, cfg, this_run)
    message = str(info.value)
    assert "written by 4 ranks: tp_size=1 x cp_size=2 x pp_size=1 x data-parallel size 2;" in message, message
    assert "this run has 4 ranks: tp_size=1 x cp_size=4 x pp_size=1 x data-parallel size 1" in message, message
    assert "dp_size" not in message


# ---------------------------------------------------------------------------------------
# 5 (on one process): the save directory's lock
# ---------------------------------------------------------------------------------------
def test_a_save_directory_is_written_by_one_run_at_a_time(tmp_path, capsys):
    lock = lock_save_dir(tmp_path)
    with pytest.raises(CheckpointError, match=rf"save_dir {tmp_path} is being written by another run: pid "
                                              rf"{os.getpid()} on host \S+, started "):
        lock_save_dir(tmp_path)                      # a second lock, even from this process
    assert main(["--train-iters", "1", "--save", str(tmp_path), "--out-dir", str(tmp_path / "o"),
                 "--no-progress"]) == 2
    assert f"is being written by another run: pid {os.getpid()}" in capsys.readouterr().err
    lock.release()
    assert (tmp_path / "minimegatron.lock").read_text() == ""             # released: names nobody
    again = lock_save_dir(tmp_path)
    assert again.previous is None
    again.release()
    # a lock file naming an owner that holds no lock: it was killed; taken over, and said
    (tmp_path / "minimegatron.lock").write_text('{"pid": 999999, "host": "h", "started": "then", "command": "x"}\n')
    taken = lock_save_dir(tmp_path)
    assert taken.previous["pid"] == 999999
    taken.release()
    assert main(["--train-iters", "1", "--save", str(tmp_path), "--out-dir", str(tmp_path / "o"),
                 "--no-progress"]) == 0


# ---------------------------------------------------------------------------------------
# 4: who did not arrive, from heartbeats (the rule; the real hang is below)
# ---------------------------------------------------------------------------------------
def _beat(rank, counts, communicating, age=0.5):
    return {"rank": rank, "time": 100.0 - age, "pid": rank, "host": "h", "doing": "iteration 3",
            "where": "x.py:1 in f", "communicating": communicating, "counts": counts}


def test_the_rank_others_wait_for_is_named_not_its_victims():
    """tp 2 x dp 2: rank 2 stopped in its own code; rank 3 waits for it in their TP group;
    ranks 0 and 1 wait in the data-parallel groups [0, 2] and [1, 3]. Rank 3 is behind on [1, 3]
    too, but it is waiting (ahead on [2, 3], inside a collective): a victim, not named."""
    beats = {0: _beat(0, [[[0, 1], 30], [[0, 2], 5]], True), 1: _beat(1, [[[0, 1], 30], [[1, 3], 5]], True),
             2: _beat(2, [[[2, 3], 28], [[0, 2], 4]], False), 3: _beat(3, [[[2, 3], 29], [[1, 3], 4]], True)}
    named, why = did_not_arrive(beats, now=100.0)
    assert named == [2], (named, why)
    assert "issued 28 collectives on group [2, 3], rank 3 issued 29 and waits there" in why[2]
    # a rank whose heartbeat stopped (frozen, or gone) is named too
    beats[1] = _beat(1, [[[0, 1], 30], [[1, 3], 5]], True, age=STALE_AFTER + 3)
    named, why = did_not_arrive(beats, now=100.0)
    assert named == [1, 2] and "no heartbeat for 8 s" in why[1][0], (named, why)


# ---------------------------------------------------------------------------------------
# under torchrun: errors printed once, bad rank files, a hung rank, a killed torchrun
# ---------------------------------------------------------------------------------------
def _torchrun(ranks: int, mode: str, flags: list[str], **popen) -> subprocess.Popen:
    """tests/workers/reliability.py under torchrun on 127.0.0.1, stdout and stderr together,
    in a session of its own (so that the test can kill torchrun's process group)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--rdzv-backend=c10d",
               "--rdzv-endpoint=127.0.0.1:0", "--local-addr=127.0.0.1", f"--nproc_per_node={ranks}",
               str(WORKER), mode, "--no-progress", "--eval-interval", "0", *flags]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True, **popen)


def _read_until(proc: subprocess.Popen, pattern: str, count: int, lines: list[str], limit: float = 240.0) -> list:
    """Read the job's output into `lines` until `pattern` has matched `count` times; the matches.
    Every match of a line counts: two ranks' prints can land on one line."""
    found, deadline = [], time.monotonic() + limit
    while len(found) < count:
        assert time.monotonic() < deadline, "".join(lines)[-3000:]
        line = proc.stdout.readline()
        assert line, f"the job ended early:\n{''.join(lines)[-3000:]}"
        lines.append(line)
        found.extend(re.finditer(pattern, line))
    return found[:count]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"                  # a zombie has ended
    except FileNotFoundError:
        return False


def _finish(proc: subprocess.Popen, lines: list[str], pids=(), limit: float = 120.0) -> str:
    """The job's whole output once it ended (killed after `limit` s); any rank of `pids` still
    alive then is killed, so that a failing test leaves no process behind."""
    try:
        rest, _ = proc.communicate(timeout=limit)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    lines.append(rest)
    return "".join(lines)


@pytest.mark.slow
def test_a_configuration_error_under_torchrun_is_printed_once():
    """Each of 2 ranks used to print it (two copies, sometimes run together on one line)."""
    proc = _torchrun(2, "main", ["--hidden-size", "30"])
    out = _finish(proc, [])
    assert proc.returncode != 0
    assert out.count("error: hidden_size=30 is not divisible by num_attention_heads=4") == 1, out
    assert re.search(r"exitcode\s*: 2 ", out), out                 # the ranks' own status, in torchrun's table


@pytest.mark.slow
def test_a_bad_rank_file_ends_the_job_at_once_naming_the_files(tmp_path):
    """Rank 1's file truncated, rank 2's missing: the ranks that read theirs used to start
    training and wait in their first collective until the timeout. Every rank now agrees on
    the load first: the job ends well inside the 10 s timeout, naming both files, once."""
    ckpt = tmp_path / "ckpt"
    save = _torchrun(3, "main", ["--train-iters", "2", "--save", str(ckpt), "--out-dir", str(tmp_path / "o1")])
    out = _finish(save, [])
    assert save.returncode == 0, out
    truncated, missing = rank_path(ckpt, 2, 1), rank_path(ckpt, 2, 2)
    truncated.write_bytes(truncated.read_bytes()[:100])
    missing.unlink()
    lines = []
    resume = _torchrun(3, "main", ["--train-iters", "4", "--load", str(ckpt), "--out-dir", str(tmp_path / "o2"),
                                   *TIMEOUT_10_S])
    started = _read_until(resume, r"rank \d pid (\d+) at ([\d.]+)", 3, lines)
    pids, ready = [int(m.group(1)) for m in started], max(float(m.group(2)) for m in started)
    while any(_alive(pid) for pid in pids) and time.time() - ready < 60:
        time.sleep(0.05)
    ended = time.time() - ready
    out = _finish(resume, lines, pids)
    assert resume.returncode != 0 and re.search(r"exitcode\s*: 2 ", out), out
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, out                                    # once, not once per rank
    assert "loading the checkpoint failed on 2 of 3 ranks" in errors[0], errors[0]
    assert f"rank 1: cannot read checkpoint {truncated}" in errors[0] and f"{missing} does not exist" in errors[0]
    assert ended < 10.0, f"the ranks ended {ended:.1f} s after they started: they waited for the timeout\n{out}"


@pytest.mark.slow
def test_a_hung_rank_is_named_and_the_job_ends_within_15_s(tmp_path):
    """tp 2 x dp 2 on 4 ranks; rank 2 hangs (sleeps) at iteration 3. Its TP partner (rank 3) and
    ranks 0 and 1 (in the data-parallel all-reduces) wait for it; the first to time out (10 s)
    names rank 2 from the heartbeats, and the job ends. torchrun's own report named rank 0 or 3."""
    lines = []
    proc = _torchrun(4, "hang:2:3", ["--tensor-model-parallel-size", "2", "--train-iters", "50",
                                     "--out-dir", str(tmp_path), *TIMEOUT_10_S])
    pids = [int(m.group(1)) for m in _read_until(proc, r"rank \d pid (\d+)", 4, lines)]
    hung_at = float(_read_until(proc, r"rank 2 hangs at ([\d.]+)", 1, lines)[0].group(1))
    while any(_alive(pid) for pid in pids) and time.time() - hung_at < 60:
        time.sleep(0.05)
    ranks_gone = time.time() - hung_at
    out = _finish(proc, lines, pids)
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and re.search(r"a collective timed out \(Timed out waiting 10000ms.*\): rank 2 did "
                                          r"not arrive$", errors[0]), out
    assert re.search(r"rank 2 issued \d+ collectives on group \[2, 3\], rank 3 issued \d+ and waits there", out), out
    assert re.search(r"rank 2: [\d.]+ s ago, iteration 3, not communicating at .*reliability.py:\d+ in train_step",
                     out), out
    assert proc.returncode != 0
    # no lower bound: rank 3 may enter its collective, and start its 10 s, before rank 2 says it hangs
    assert ranks_gone < 15.0, f"the ranks ended {ranks_gone:.1f} s after rank 2 hung\n{out}"


@pytest.mark.slow
def test_killing_torchrun_kills_its_ranks_and_frees_the_save_directory(tmp_path, capsys):
    """SIGKILL to torchrun's process group used to leave its ranks (each in a session of its
    own) training and writing --save. They now die with it (the kernel's parent-death signal);
    while they ran, a second run on the same --save was refused, naming rank 0; after, the
    lock their rank 0 held is free again (the kernel released it), and taken over."""
    ckpt = tmp_path / "ckpt"
    lines = []
    proc = _torchrun(2, "main", ["--train-iters", "100000", "--save", str(ckpt), "--save-interval", "2",
                                 "--out-dir", str(tmp_path / "o1"), *TIMEOUT_10_S])
    pids = {int(m.group(1)): int(m.group(2)) for m in _read_until(proc, r"rank (\d) pid (\d+)", 2, lines)}
    deadline = time.monotonic() + 120
    while not (ckpt / "latest").exists():                              # training and saving
        assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
        time.sleep(0.1)
    assert main(["--train-iters", "1", "--save", str(ckpt), "--out-dir", str(tmp_path / "o2"),
                 "--no-progress"]) == 2
    assert f"is being written by another run: pid {pids[0]} on host" in capsys.readouterr().err
    os.killpg(proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    while any(_alive(pid) for pid in pids.values()) and time.monotonic() - killed < 15:
        time.sleep(0.05)
    gone = time.monotonic() - killed
    proc.wait(10)
    orphans = [pid for pid in pids.values() if _alive(pid)]
    for pid in orphans:                                                # leave nothing behind
        os.kill(pid, signal.SIGKILL)
    assert not orphans, f"ranks {orphans} still ran {gone:.0f} s after torchrun died"
    assert gone < 5.0, gone
    latest = (ckpt / "latest").read_text()
    time.sleep(1.0)
    assert (ckpt / "latest").read_text() == latest                     # nobody writes it any more
    assert main(["--train-iters", "1", "--save", str(ckpt), "--out-dir", str(tmp_path / "o3"),
                 "--no-progress"]) == 0
    assert f"took over the lock of {ckpt}, left by a run that ended without releasing it (pid {pids[0]}" in \
        capsys.readouterr().out
