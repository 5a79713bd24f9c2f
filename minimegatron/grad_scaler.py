"""Loss scaling for fp16 training (chapter 06 §3): the factor S the loss is multiplied by before the
backward, so that small gradients survive in float16, and how S moves.

    scaler = DynamicGradScaler(initial_scale=2**32, min_scale=1.0, growth_interval=1000, hysteresis=2)
    (loss * scaler.scale).backward()
    found_inf = ...                    # optim.Optimizer: unscale, check every rank, agree
    scaler.update(found_inf)           # the step is skipped if found_inf

`DynamicGradScaler.update` has Megatron-Core's semantics (update_dynamic_scale, exercise 6.1);
Megatron's flags --initial-loss-scale, --min-loss-scale, --loss-scale-window, --hysteresis, and
--loss-scale S (a ConstantGradScaler); growth factor 2, back-off 0.5. The scale is a Python
float (a power of two times the initial scale, exact).

Megatron: megatron/core/optimizer/grad_scaler.py.
"""

from __future__ import annotations

__all__ = ["ConstantGradScaler", "DynamicGradScaler", "update_dynamic_scale", "build_grad_scaler"]


class ConstantGradScaler:
    """A fixed loss scale (--loss-scale S): overflowing steps are still skipped, the scale never
    moves."""

    def __init__(self, scale: float):
        if not scale > 0:
            raise ValueError(f"loss scale {scale} must be positive")
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])


class DynamicGradScaler:
    """The loss scale that backs off on overflow and grows after a window of clean steps
    (the module docstring's rules)."""

    def __init__(self, initial_scale: float = 2.0 ** 32, min_scale: float = 1.0, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2):
        checks = [(initial_scale > 0, f"initial_scale={initial_scale} must be positive"),
                  (0 < min_scale <= initial_scale, f"min_scale={min_scale} must be in (0, initial_scale={initial_scale}]"),
                  (growth_factor > 1, f"growth_factor={growth_factor} must be > 1"),
                  (0 < backoff_factor < 1, f"backoff_factor={backoff_factor} must be in (0, 1)"),
                  (growth_interval > 0, f"growth_interval={growth_interval} must be positive"),
                  (hysteresis > 0, f"hysteresis={hysteresis} must be positive")]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        self.scale, self.min_scale = float(initial_scale), float(min_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self.growth_tracker, self.hysteresis_tracker = 0, hysteresis

    def update(self, found_inf: bool) -> None:
        update_dynamic_scale(self, found_inf)

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker, self.hysteresis_tracker = int(state["growth_tracker"]), int(state["hysteresis_tracker"])


def update_dynamic_scale(scaler: DynamicGradScaler, found_inf: bool) -> None:
    """One step of the dynamic loss scale, in place: scaler.scale, growth_tracker (clean steps
    in a row) and hysteresis_tracker (overflows left before a back-off), with the scaler's
    growth_interval, hysteresis, growth_factor, backoff_factor and min_scale. A new scaler
    starts with growth_tracker 0 and hysteresis_tracker = hysteresis. Megatron-Core's
    DynamicGradScaler.update:

      found_inf (an overflow): growth_tracker = 0; hysteresis_tracker drops by 1; when it is
          then <= 0, scale = max(scale * backoff_factor, min_scale). Clean steps do NOT refill
          hysteresis_tracker, only a growth does: once `hysteresis` overflows have come
          (however far apart), every further overflow backs off again;
      a clean step: growth_tracker counts up; when it reaches growth_interval (Megatron's
          --loss-scale-window: clean steps in a row), scale *= growth_factor and both trackers
          are reset (growth_tracker 0, hysteresis_tracker = hysteresis).

    E.g. hysteresis 2, growth_interval 3, from 1024: overflow, overflow, overflow, 3 clean steps
    give the scales 1024, 512, 256, 256, 256, 512."""
    # BEGIN EXERCISE 6.1: the dynamic loss scaler's update | hint: two counters: clean steps in a row (which an overflow restarts) and overflows left before backing off (which only a growth refills)
    if found_inf:
        scaler.growth_tracker = 0
        scaler.hysteresis_tracker -= 1
        if scaler.hysteresis_tracker <= 0:
            scaler.scale = max(scaler.scale * scaler.backoff_factor, scaler.min_scale)
    else:
        scaler.growth_tracker += 1
        if scaler.growth_tracker == scaler.growth_interval:
            scaler.growth_tracker, scaler.hysteresis_tracker = 0, scaler.hysteresis
            scaler.scale *= scaler.growth_factor
    # END EXERCISE


def build_grad_scaler(cfg) -> ConstantGradScaler | DynamicGradScaler | None:
    """The scaler a TrainConfig asks for, as Megatron chooses it: constant when loss_scale is set
    (bf16 or fp16); dynamic with fp16 otherwise; None otherwise (bf16 has float32's range)."""
    if cfg.loss_scale is not None and (cfg.bf16 or cfg.fp16):
        return ConstantGradScaler(cfg.loss_scale)
    if not cfg.fp16:
        return None
    return DynamicGradScaler(cfg.initial_loss_scale, cfg.min_loss_scale, growth_interval=cfg.loss_scale_window,
                             hysteresis=cfg.hysteresis)
