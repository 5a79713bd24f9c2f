"""Rank function for tests/test_compile.py: one layout trained eagerly and with --kernels
compile in the same world, with the first step's messages of each."""

from __future__ import annotations

import dataclasses

from minimegatron.testing import train_layout


def eager_and_compiled(model, cfg, dp: int, batches: list) -> dict:
    """{"eager": ..., "compiled": ...}, each train_layout's losses, grads, params and the first
    step's messages as (op, tag, group size, bytes)."""
    out = {}
    for name, kernels in (("eager", "torch"), ("compiled", "compile")):
        result = train_layout(model, dataclasses.replace(cfg, kernels=kernels), dp, batches)[0]
        out[name] = {key: result[key] for key in ("losses", "grads", "params")}
        out[name]["messages"] = [(r.op, r.tag, r.group_size, r.nbytes) for r in result["records"]]
    return out
