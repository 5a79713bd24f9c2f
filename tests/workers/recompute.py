"""Rank functions for tests/test_recompute.py: each layout trained twice in one spawned world,
without and with activation recompute, from the same random states."""

from __future__ import annotations

import dataclasses

from minimegatron.config import DEFAULT_RECOMPUTE_MODULES
from minimegatron.testing import train_layout
from minimegatron.tp import model_parallel_manual_seed


def _seeded(cfg):
    """after_build for train_layout: the dropout streams seeded as the training loop seeds them
    (train._run), so that two runs of one layout draw the same masks."""
    return lambda chunks, layout: model_parallel_manual_seed(cfg.data_seed, tp_rank=layout.tp_rank,
                                                             pp_rank=layout.pp_rank)


def with_and_without_recompute(layouts: list[tuple]) -> list[dict]:
    """For each (name, model_cfg, train_cfg with recompute, dp, batches): "plain" and "recompute",
    each train_layout's losses, first-step gradients and final parameters (full, single-device
    names), and the recompute run's first-step ledger records tagged "recompute" (op, bytes) and
    its summary for run_report.communication_checks ("records" by dimension, "pp_rank", "ep_group")."""
    from minimegatron.parallel_state import get_group_ranks
    from minimegatron.run_report import KEYS_OF_THIS_RANK, records_by_dimension

    out = []
    for name, model, cfg, dp, batches in layouts:
        plain_cfg = dataclasses.replace(cfg, recompute_granularity=None, recompute_method=None,
                                        recompute_num_layers=None, recompute_modules=DEFAULT_RECOMPUTE_MODULES)
        runs = {}
        for label, c in (("plain", plain_cfg), ("recompute", cfg)):
            result = train_layout(model, c, dp, batches, after_build=_seeded(c))[0]
            runs[label] = {k: result[k] for k in ("losses", "grads", "params")}
            runs[label]["recomputed"] = [(r.op, r.nbytes) for r in result["records"] if r.tag.startswith("recompute")]
        groups = {k: get_group_ranks(k) for k in KEYS_OF_THIS_RANK}
        runs["summary"] = {"records": records_by_dimension(result["records"], groups), "pp_rank": result["pp_rank"],
                           "ep_group": groups.get("ep", [])}
        out.append({"name": name, **runs})
    return out
