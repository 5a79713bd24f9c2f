"""--profile (minimegatron/profiling.py, chapter 07): torch.profiler over the steps Megatron's
flags name, a Chrome trace per profiling rank and rank 0's top operators; bad step ranges are
named before anything runs."""

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minimegatron.arguments import parse_command_line
from minimegatron.config import ConfigError, TrainConfig

ROOT = Path(__file__).resolve().parents[1]


def test_the_flags_are_megatrons_and_a_bad_range_is_named():
    _, cfg, _ = parse_command_line(["--profile", "--use-pytorch-profiler", "--profile-step-start", "2",
                                    "--profile-step-end", "4", "--profile-ranks", "1"], world_size=1)
    assert (cfg.profile, cfg.profile_step_start, cfg.profile_step_end, cfg.profile_ranks) == (True, 2, 4, (1,))
    with pytest.raises(ConfigError, match=r"profile_step_start=5 and profile_step_end=4 must satisfy"):
        TrainConfig(profile=True, profile_step_start=5, profile_step_end=4).validate()
    with pytest.raises(ConfigError, match=r"train_iters=3"):
        TrainConfig(profile=True, profile_step_start=1, profile_step_end=4, train_iters=3).validate()


@pytest.mark.slow
def test_two_ranks_write_their_traces_and_rank_0_prints_its_top_operators(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--rdzv-backend=c10d",
               "--rdzv-endpoint=127.0.0.1:0", "--local-addr=127.0.0.1", "--nproc_per_node=2",
               "-m", "minimegatron.train", "--preset", "tiny", "--tensor-model-parallel-size", "2",
               "--sequence-parallel", "--train-iters", "5", "--profile", "--profile-step-start", "2",
               "--profile-step-end", "4", "--eval-interval", "0", "--no-progress", "--out-dir", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "--profile: steps 2..3, a Chrome trace per rank in" in done.stdout
    assert "Self CPU time total" in done.stdout and "c10d::" in done.stdout     # the collectives are in it
    for rank in (0, 1):
        with gzip.open(tmp_path / "torch_profile" / f"rank-{rank}.json.gz", "rt") as f:
            events = json.load(f)["traceEvents"]
        steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
        assert steps == {"ProfilerStep#2", "ProfilerStep#3"}, steps
