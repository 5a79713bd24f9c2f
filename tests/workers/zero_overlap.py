"""Rank function for tests/test_zero_overlap.py: ZeRO-1/2 trained with and without
--overlap-grad-reduce / --overlap-param-gather in one world."""

from __future__ import annotations

import dataclasses

from minimegatron.testing import train_layout


def with_and_without_overlap(model, cfg, dp: int, batches: list) -> dict:
    """{name: train_layout's losses, grads, params, the first step's messages (op, tag, bytes)
    and, overlapped, what the wrapper saw: the buckets launched during the backward of the last
    step, and the all-gathers still in flight after the last optimizer step}."""
    out = {}
    for name, flags in (("plain", {}), ("grads", dict(overlap_grad_reduce=True)),
                        ("grads+params", dict(overlap_grad_reduce=True, overlap_param_gather=True))):
        in_flight = []

        def watch(chunks, layout, in_flight=in_flight):      # how many gathers each step leaves in flight
            wrapper, step = chunks[0], chunks[0].after_optimizer_step

            def counted():
                step()
                in_flight.append(len(wrapper._gathers))
            wrapper.after_optimizer_step = counted
        result, chunks, _, _ = train_layout(model, dataclasses.replace(cfg, **flags), dp, batches, after_build=watch)
        wrapper = chunks[0]
        out[name] = {key: result[key] for key in ("losses", "grads", "params")}
        out[name]["messages"] = sorted((r.op, r.tag, r.nbytes) for r in result["records"])
        out[name]["launched_in_backward"] = (wrapper.timeline.launched_during_backward()
                                             if wrapper.timeline is not None else [])
        out[name]["buckets"] = len(wrapper.buckets)
        out[name]["gathers_in_flight"] = in_flight
    return out
