"""Rank functions for tests/test_precision.py: mixed-precision training runs of several layouts
in one spawned world (testing.train_layout, the loop's own pieces), and an fp16 run in which one
rank's gradient overflows at a chosen step."""

from __future__ import annotations

from minimegatron import grad_scaler
from minimegatron.dp import unwrap
from minimegatron.testing import train_layout


def train_layouts(layouts: list[tuple]) -> list[dict]:
    """For each (name, model_cfg, train_cfg, dp, batches): train_layout's "losses", "grads",
    "params", and the loss scales the optimizer ran with (fp16)."""
    out = []
    for name, model, cfg, dp, batches in layouts:
        result, _, _, optimizer = train_layout(model, cfg, dp, batches)
        out.append({"name": name, "losses": result["losses"], "grads": result["grads"], "params": result["params"],
                    "scale": optimizer.loss_scale})
    return out


def overflow_on_one_rank(model, cfg, dp: int, batches: list, rank: int, step: int) -> dict:
    """Train with `rank`'s first weight gradient turned to inf in the backward of step `step`
    (counted from 0). Returns this rank's (found_inf, loss scale) after each step's scaler
    update (the scaler's own record), the losses, and the final parameters (full,
    single-device names)."""
    import torch.distributed as dist

    seen: list[tuple[bool, float]] = []
    real_update = grad_scaler.DynamicGradScaler.update

    def recorded_update(self, found_inf):
        real_update(self, found_inf)
        seen.append((bool(found_inf), self.scale))

    def poison(chunks, layout):
        if dist.get_rank() == rank:
            weight = next(p for p in unwrap(chunks[0]).parameters() if p.dim() == 2)
            weight.register_hook(lambda g: g * float("inf") if len(seen) == step else g)

    grad_scaler.DynamicGradScaler.update = recorded_update
    try:
        result = train_layout(model, cfg, dp, batches, after_build=poison)[0]
    finally:
        grad_scaler.DynamicGradScaler.update = real_update
    return {"seen": seen, "losses": result["losses"], "params": result["params"]}
