"""Chapter 08: beyond one machine. The training command under two torchrun agents, as two
"nodes" of 2 ranks each (--nnodes 2, a c10d rendezvous on 127.0.0.1), trains exactly as one agent
with 4 ranks: the same losses and the same final model, bit for bit (tp 2 x dp 2, saved with
--ckpt-format torch_dist and compared as single-device tensors)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from minimegatron.dist_checkpoint import load_full_state

ARGS = ["-m", "minimegatron.train", "--preset", "tiny", "--train-iters", "3", "--eval-interval", "0", "--no-progress",
        "--tensor-model-parallel-size", "2", "--ckpt-format", "torch_dist"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(*flags: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *flags]


def _run(tmp: Path, name: str, agents: list[list[str]]) -> tuple[list[float], dict]:
    out = tmp / name
    procs = [subprocess.Popen(agent + ARGS + ["--out-dir", str(out), "--save", str(out / "ckpt")], env=ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for agent in agents]
    for proc in procs:
        text, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, text[-3000:]
    losses = json.loads((out / "losses.json").read_text())["train"]
    return losses, load_full_state(out / "ckpt" / "iter_0000003")


def test_two_agents_train_as_one(tmp_path):
    one = _run(tmp_path, "one", [_torchrun("--standalone", "--nproc-per-node", "4")])
    port = _port()
    rendezvous = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                  "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes"]
    two = _run(tmp_path, "two", [_torchrun(*rendezvous, "--node-rank", str(node)) for node in (0, 1)])
    assert two[0] == one[0] and len(one[0]) == 3
    assert set(two[1]) == set(one[1])
    for name, t in one[1].items():
        assert torch.equal(two[1][name], t), name
