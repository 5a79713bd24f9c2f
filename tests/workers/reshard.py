"""Rank function for tests/test_reshard.py: the training command's own train() for several
configs in turn, in one spawned world (each a layout of the whole world)."""

from __future__ import annotations


def train_in_turn(runs: list[tuple]) -> list[list[float]]:
    """minimegatron.train.train(model_cfg, train_cfg) for each (model_cfg, train_cfg); the
    losses each returned (the checkpoint's history included after a resume)."""
    from minimegatron.train import train
    return [train(model, cfg).losses for model, cfg in runs]
