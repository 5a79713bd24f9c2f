"""Rank function for tests/test_step_communication.py: in one spawned world of 4 ranks, train
one step of each layout with the training loop's pieces (testing.train_layout) while comm's
ledger records, and return what the rank measured beside what analysis/communication.py says.
"""

from __future__ import annotations

from collections import Counter

from minimegatron import comm
from minimegatron.analysis import rank_parameters
from minimegatron.analysis.memory import local_parameter_counts
from minimegatron.parallel_state import get_group_ranks
from minimegatron.run_report import KEYS_OF_THIS_RANK, records_by_dimension
from minimegatron.testing import make_batches, train_layout


def measure_layouts(layouts: list[tuple]) -> list[dict]:
    """For each (name, model_cfg, train_cfg, dp): this rank's summary as run_report._summary
    gives it ("pp_rank", "ep_group", "params", "records"), of one training step; the
    full-model gathers train_layout does for its own record (tags "full", "inspect") left out."""
    import minimegatron.testing as testing_module
    out = []
    for name, model, cfg, dp in layouts:
        batches = make_batches(model, 1, cfg.micro_batch_size * cfg.grad_accum_steps * dp, cfg.seq_length)
        records, real_step = [], testing_module.train_step

        def recorded_step(*args, **kwargs):
            with comm.record_communication() as ledger:
                result = real_step(*args, **kwargs)
            records.extend(r for r in ledger if r.tag not in ("full", "inspect"))
            return result
        testing_module.train_step = recorded_step            # train_layout looks it up at every step
        try:
            _, chunks, layout, _ = train_layout(model, cfg, dp, batches)
        finally:
            testing_module.train_step = real_step
        groups = {k: get_group_ranks(k) for k in KEYS_OF_THIS_RANK}
        out.append({"name": name, "pp_rank": layout.pp_rank, "ep_group": groups["ep"], "pp_group": groups["pp"],
                    "params": local_parameter_counts(chunks),
                    "formula_params": rank_parameters(model, cfg, layout.pp_rank),
                    "records": {d: Counter(c) for d, c in records_by_dimension(records, groups).items()}})
    return out
