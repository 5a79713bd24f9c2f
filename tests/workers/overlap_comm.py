"""Rank function for tests/test_overlap_comm.py: one layout trained plain and with chapter 07's
--overlap-sp-backward and --overlap-p2p-communication, in one world."""

from __future__ import annotations

import dataclasses

from minimegatron.pp import PipelineComm
from minimegatron.testing import train_layout
from minimegatron.tp import layers


def plain_and_overlapped(model, cfg, dp: int, batches: list) -> dict:
    """{"plain" | "overlapped": train_layout's losses, grads and params, the first step's
    messages (op, tag, bytes) in order, how many column-parallel backwards ran the overlapped
    form, and how many receives the executor posted one op ahead}."""
    out = {}
    overlapped_backward, posted_ahead = layers.sequence_parallel_linear_backward_overlapped, PipelineComm.post_recv_ahead
    calls = {"backward": 0, "ahead": 0}

    def counted_backward(*args, **kwargs):
        calls["backward"] += 1
        return overlapped_backward(*args, **kwargs)

    def counted_ahead(self, op):
        calls["ahead"] += 1
        return posted_ahead(self, op)
    layers.sequence_parallel_linear_backward_overlapped, PipelineComm.post_recv_ahead = counted_backward, counted_ahead
    try:
        for name, flags in (("plain", {}), ("overlapped", dict(overlap_sp_backward=True, overlap_p2p_comm=True))):
            calls.update(backward=0, ahead=0)
            result, _, _, _ = train_layout(model, dataclasses.replace(cfg, **flags), dp, batches)
            out[name] = {key: result[key] for key in ("losses", "grads", "params")}
            out[name]["messages"] = [(r.op, r.tag, r.nbytes) for r in result["records"]]
            out[name].update(calls)
    finally:
        layers.sequence_parallel_linear_backward_overlapped, PipelineComm.post_recv_ahead = overlapped_backward, posted_ahead
    return out
