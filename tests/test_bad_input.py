"""Bad input to the training entry, from the reliability probe of issue 32 (item 4): each case
refused with a message naming the flag and the number, before training where it can be, and
never a traceback, a NaN run that exits 0, or a damaged checkpoint loaded in silence.

Every case runs `train.main` in this process on the tiny preset (one process, no world),
except the launcher cases, which start a process (the import that must not happen) or
torchrun (the orphan test, marked slow).
"""

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from minimegatron import lifeline, nonfinite
from minimegatron.checkpoint import CheckpointError, load_checkpoint
from minimegatron.config import ConfigError, ModelConfig, TrainConfig
from minimegatron.dist_checkpoint import load_full_state
from minimegatron.parallel_state import Layout
from minimegatron.nonfinite import NonFiniteError, check_finite_parameters
from minimegatron.parallelize import build_model, build_optimizer
from minimegatron.train import main

ROOT = Path(__file__).resolve().parents[1]
TWO_TO_100 = str(2.0 ** 100)            # a power of 2 (1.27e30) at which every fp16 gradient overflows


def _run(tmp_path, *argv) -> list[str]:
    return ["--preset", "tiny", "--no-progress", "--out-dir", str(tmp_path / "out"), *argv]


def _error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err


# ---------------------------------------------------------------------------------------
# flags the run would ignore, and values it cannot take: refused before training
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, expected", [
    (["--loss-scale", "8"], "loss_scale=8 without fp16 or bf16"),
    (["--fp16", "--loss-scale", "3"], "--fp16 --loss-scale 3: a static loss scale must be a power of 2"),
    (["--bf16", "--loss-scale", "1e30"], "--bf16 --loss-scale 1e+30: a static loss scale must be a power of 2"),
    (["--initial-loss-scale", "1024"], "--initial-loss-scale: they set fp16's dynamic loss scale"),
    (["--fp16", "--loss-scale", "8", "--hysteresis", "3"], "--hysteresis: with --loss-scale 8 the scale is constant"),
    (["--recompute-modules", "mlp"], "--recompute-modules mlp without --recompute-granularity selective"),
    (["--recompute-modules", "core_attn"], "--recompute-modules core_attn without --recompute-granularity"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
      "--recompute-modules", "mlp"], "--recompute-modules mlp without --recompute-granularity selective"),
    (["--recompute-granularity", "selective", "--recompute-modules", "moe"],
     "recompute_modules moe on a dense model (num_experts unset)"),
    (["--kernels", "triton", "--attention-backend", "naive"], "kernels='triton' with attention_backend='naive'"),
    (["--fp8-recipe", "delayed"], "--fp8-recipe without --fp8-format: no FP8 at all, the run would train in float32"),
    (["--bf16", "--fp8-amax-history-len", "16"], "--fp8-amax-history-len without --fp8-format"),
    (["--fp8-format", "hybrid", "--fp8-amax-history-len", "1000000000"],
     "fp8_amax_history_len=1000000000 is longer than Transformer Engine's default history (1024) and than the "
     "amaxes this run records per tensor role (train_iters=40 x grad_accum_steps=1 = 40)"),
])
def test_an_ignored_or_impossible_flag_is_refused_by_name(argv, expected, tmp_path, capsys):
    assert main(_run(tmp_path, *argv)) == 2
    err = _error(capsys)
    assert err.startswith("error: ") and expected in err, err
    assert not (tmp_path / "out").exists()                           # nothing ran


@pytest.mark.parametrize("fields, expected", [
    (dict(recompute_modules=("mlp",)), "recompute_modules=['mlp'] with recompute_granularity=None"),
    (dict(fp8_recipe="tensorwise"), "fp8_recipe='tensorwise' without fp8_format"),
    (dict(loss_scale=4.0), "loss_scale=4 without fp16 or bf16"),
    (dict(fp16=True, loss_scale=2.0 ** 0.5), "a static loss scale must be a power of 2"),
])
def test_the_config_itself_refuses_what_it_would_ignore(fields, expected):
    """The same rules in TrainConfig.validate, for runs built without the command line (spawned
    worlds, demos): before any rank starts."""
    with pytest.raises(ConfigError, match=re.escape(expected)):
        TrainConfig(**fields).validate()


def test_the_history_bound_admits_te_default_and_what_a_run_records():
    """1024 (Transformer Engine's default) always; longer, as many as the run records."""
    TrainConfig(fp8_format="hybrid", fp8_amax_history_len=1024, train_iters=3, lr_warmup_iters=0).validate()
    TrainConfig(fp8_format="hybrid", fp8_amax_history_len=4000, train_iters=2000, grad_accum_steps=2).validate()
    with pytest.raises(ConfigError, match="fp8_amax_history_len=4001"):
        TrainConfig(fp8_format="hybrid", fp8_amax_history_len=4001, train_iters=2000, grad_accum_steps=2).validate()


def test_a_save_directory_that_cannot_be_written_is_named(tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for save, expected in ((a_file, f"{a_file} is a file, not a directory"),
                           (a_file / "below", f"{a_file} is a file, not a directory"),
                           ("/proc/minimegatron-ckpt", "save_dir /proc/minimegatron-ckpt cannot be written")):
        assert main(_run(tmp_path, "--train-iters", "1", "--save", str(save))) == 2
        err = _error(capsys)
        assert err.startswith("error: save_dir ") and expected in err, err
    if os.geteuid() != 0:                                            # root writes through the mode bits
        read_only = tmp_path / "read_only"
        read_only.mkdir(mode=0o555)
        assert main(_run(tmp_path, "--train-iters", "1", "--save", str(read_only / "ckpt"))) == 2
        assert "cannot be written: Permission denied" in _error(capsys)


@pytest.mark.parametrize("seq_length", ["1", "31"])
def test_any_sequence_length_trains_without_context_parallelism(seq_length, tmp_path, capsys):
    """cp 1 keeps every token (the zig-zag's 2 cp chunks are context parallelism's)."""
    assert main(_run(tmp_path, "--train-iters", "1", "--seq-length", seq_length, "--eval-interval", "0")) == 0
    assert "final train loss" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------
# fp16: a run that goes to NaN stops; a run whose every step is skipped stops, naming the scale
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, expected", [
    (["--lr", "1e30", "--min-lr", "0", "--initial-loss-scale", "1024"],      # AdamW's first step: inf fp16 weights
     "iteration 2: the loss is nan at loss scale 1024;"),
    (["--lr", "1e30", "--min-lr", "0", "--initial-loss-scale", "1024", "--save-interval", "1"],
     "iteration 1: parameters are not finite (decoder."),                     # they are, before iteration 1's save
    (["--init-method-std", "1000"], "iteration 1: the loss is nan at loss scale 4.29497e+09;"),   # the forward overflows
])
def test_fp16_training_that_goes_to_nan_stops_and_saves_nothing(argv, expected, tmp_path, capsys):
    """The finiteness check used to be skipped whenever there was a loss scaler: these runs
    exited 0 and saved all-NaN checkpoints. A non-finite loss is not the scaler's signal (the
    loss is computed before any scaling), so the run stops there; and no checkpoint is written
    with non-finite parameters."""
    save = tmp_path / "ckpt"
    assert main(_run(tmp_path, "--train-iters", "6", "--fp16", "--lr-warmup-iters", "0", "--ckpt-format",
                     "torch_dist", "--save", str(save), *argv)) == 1
    err = _error(capsys)
    assert err.startswith(f"error: {expected}"), err
    assert [p.name for p in save.iterdir()] == ["minimegatron.lock"]


def test_a_checkpoint_is_never_written_with_non_finite_parameters(tmp_path):
    model = ModelConfig.llama(hidden_size=32, num_layers=2, num_attention_heads=4, max_position_embeddings=32)
    cfg = TrainConfig(seq_length=32, train_iters=1, lr_warmup_iters=0, progress=False)
    chunks = build_model(model, cfg, Layout())
    optimizer = build_optimizer(chunks, cfg, Layout())
    check_finite_parameters(chunks, optimizer, 3)                     # finite: no error
    with torch.no_grad():
        dict(chunks[0].named_parameters())["decoder.layers.1.mlp.linear_fc2.weight"][0, 0] = float("inf")
    with pytest.raises(NonFiniteError, match=r"^iteration 3: parameters are not finite "
                                             r"\(decoder.layers.1.mlp.linear_fc2.weight\)"):
        check_finite_parameters(chunks, optimizer, 3)


def test_skipped_steps_are_reported(tmp_path, capsys):
    """fp16's default scale 2^32 overflows the tiny model's gradients for its first steps: each
    is skipped and the scale halved (no error: it can still go lower), and the final line says
    how many were skipped."""
    assert main(_run(tmp_path, "--train-iters", "2", "--fp16", "--eval-interval", "0")) == 0
    assert "(2 steps of this run skipped by the loss scaler: the scaled gradients overflowed)" in \
        capsys.readouterr().out


@pytest.mark.parametrize("argv, source", [
    (["--loss-scale", TWO_TO_100], "--loss-scale 1.26765e+30"),
    (["--initial-loss-scale", TWO_TO_100, "--min-loss-scale", TWO_TO_100], "--min-loss-scale 1.26765e+30"),
])
def test_a_run_that_skips_every_step_of_a_window_stops_naming_the_scale(argv, source, tmp_path, capsys,
                                                                        monkeypatch):
    """A scale that cannot go lower and overflows on every batch used to skip every step, say
    nothing and exit 0. A window of 3 steps here (10 in a run) stops a 6-step run at 3; a run
    shorter than the window stops at its end."""
    monkeypatch.setattr(nonfinite, "SKIPPED_STEPS_WINDOW", 3)
    assert main(_run(tmp_path, "--train-iters", "6", "--fp16", *argv)) == 1
    err = _error(capsys)
    assert err.startswith("error: iterations 1-3: the loss scaler skipped every step: the gradients, scaled by "
                          f"1.26765e+30 ({source}"), err
    assert main(_run(tmp_path, "--train-iters", "2", "--fp16", *argv)) == 1
    assert _error(capsys).startswith("error: iterations 1-2: the loss scaler skipped every step")


# ---------------------------------------------------------------------------------------
# checksums: a damaged checkpoint piece is refused, naming the file and the tensor
# ---------------------------------------------------------------------------------------
def _flip_a_byte_of(path: Path, tensor: torch.Tensor) -> None:
    """Flip one byte in the middle of `tensor`'s bytes where they sit in the file `path`."""
    data = bytearray(path.read_bytes())
    raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    at = data.find(raw)
    assert at >= 0 and data.find(raw, at + 1) < 0, "the tensor's bytes are not in the file exactly once"
    data[at + len(raw) // 2] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_a_checkpoint_piece_with_a_flipped_byte_is_refused_naming_the_file(ckpt_format, tmp_path, capsys):
    """It used to load, and the loss jumped (5.26 -> 5.55 in the probe)."""
    save = tmp_path / "ckpt"
    assert main(_run(tmp_path, "--train-iters", "1", "--eval-interval", "0", "--ckpt-format", ckpt_format,
                     "--save", str(save))) == 0
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    if ckpt_format == "torch":
        damaged = save / "iter_0000001.pt"
        tensor, piece = load_checkpoint(damaged)["model"][name], f"model/{name}"
    else:
        damaged = save / "iter_0000001" / "rank_00000.pt"
        tensors = torch.load(damaged, weights_only=True)["tensors"]
        piece = next(k for k in tensors if k.startswith(f"model/{name}/"))
        tensor, piece = tensors[piece], f"tensors/{piece}"
    _flip_a_byte_of(damaged, tensor)
    assert main(_run(tmp_path, "--train-iters", "2", "--eval-interval", "0", "--load", str(save))) == 2
    err = _error(capsys)
    assert err.startswith(f"error: checkpoint file {damaged} is damaged: {piece} differs from the CRC-32 recorded "
                          f"when it was saved"), err
    with pytest.raises(CheckpointError, match="is damaged"):
        load_checkpoint(damaged) if ckpt_format == "torch" else load_full_state(damaged.parent)


# ---------------------------------------------------------------------------------------
# the launcher: a rank dies with it from its first line
# ---------------------------------------------------------------------------------------
def _torchrun_env(port: int) -> dict[str, str]:
    return dict(os.environ, TORCHELASTIC_RUN_ID="test", RANK="0", TORCHELASTIC_USE_AGENT_STORE="True",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=str(ROOT))


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]                                     # closed when the socket is


def test_a_rank_whose_launcher_is_gone_exits_before_importing_torch():
    """`import minimegatron` under torchrun's variables, with nothing at the store's address:
    the process says so and exits 1, from the package's first line (torch never imported)."""
    proc = subprocess.run([sys.executable, "-c", "import minimegatron; print('imported')"], capture_output=True,
                          text=True, env=_torchrun_env(_closed_port()), timeout=60)
    assert proc.returncode == 1 and "imported" not in proc.stdout, (proc.stdout, proc.stderr)
    assert "rank 0 (pid " in proc.stderr and "its launcher is gone (nothing listens at MASTER_ADDR:MASTER_PORT" \
        in proc.stderr, proc.stderr


def test_a_live_store_is_a_live_launcher(monkeypatch):
    with socket.socket() as store:
        store.bind(("127.0.0.1", 0))
        store.listen()
        for key, value in _torchrun_env(store.getsockname()[1]).items():
            monkeypatch.setenv(key, value)
        assert lifeline.is_torchrun_rank() and lifeline.launcher_gone() is None
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")      # the store is rank 0's: not proof
    assert lifeline.launcher_gone() is None


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal and /proc are Linux's")
def test_a_launcher_killed_while_its_ranks_start_leaves_no_orphan(tmp_path):
    """SIGKILL to torchrun as soon as its two ranks exist (they are importing torch): they used
    to live on for 1-3 minutes, adopted by pid 1, waiting in the rendezvous. Each now dies with
    it (the signal armed at `import minimegatron`) or, started too late for that, exits seeing
    the store gone. About 10 s."""
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             "-m", "minimegatron.train", "--preset", "tiny", "--train-iters", "100000",
                             "--no-progress", "--out-dir", str(tmp_path / "out")],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    deadline = time.monotonic() + 60
    while len(_children(proc.pid)) < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)
    ranks = _children(proc.pid)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    assert len(ranks) == 2, f"torchrun started {ranks}"
    killed = time.monotonic()
    while any(_alive(pid) for pid in ranks) and time.monotonic() - killed < 30:
        time.sleep(0.05)
    orphans = [pid for pid in ranks if _alive(pid)]
    for pid in orphans:                                               # leave nothing behind
        os.kill(pid, signal.SIGKILL)
    assert not orphans, f"ranks {orphans} outlived torchrun by 30 s"


_SPAWN_AND_LEAVE = """
import multiprocessing, os, pickle, sys
from minimegatron import launch
if __name__ == "__main__":
    ctx = multiprocessing.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    port = int(sys.argv[1])          # nothing listens there: the store would be waited for 120 s
    child = ctx.Process(target=launch._rank_main, args=(0, 2, port, pickle.dumps((print, (), {})), writer, 120.0))
    child.start()
    print(child.pid, flush=True)
    os._exit(0)                      # leave at once (no join), while the child imports torch
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_spawned_rank_whose_parent_is_gone_exits_at_start(tmp_path):
    """launch.spawn's rank, its parent gone before the rank could arm the parent-death signal
    (it was importing torch): it exits on entering _rank_main, instead of waiting 120 s for
    a store that is gone. About 10 s."""
    script = tmp_path / "spawn_and_leave.py"
    script.write_text(_SPAWN_AND_LEAVE)
    proc = subprocess.Popen([sys.executable, str(script), str(_closed_port())], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    child = int(proc.stdout.readline())          # (the child shares the pipe: read its first line, not to EOF)
    proc.wait(60)
    proc.stdout.close()
    started = time.monotonic()
    while _alive(child) and time.monotonic() - started < 60:
        time.sleep(0.1)
    if _alive(child):
        os.kill(child, signal.SIGKILL)
        pytest.fail("the spawned rank outlived its parent by 60 s")
