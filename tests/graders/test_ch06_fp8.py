"""Graders of chapter 06, low precision: the dynamic loss scaler's update (6.1), an FP8 cast with
its scale and saturation (6.2), delayed scaling's amax-history update (6.3) and the spot-the-bug
FP8 amax (6.4).

The oracles: sequences worked out by hand from Megatron-Core's and Transformer Engine's rules
(each expected value is derived in a comment), FP8 values read off the formats' definitions
(sign, exponent, mantissa), and properties that hold whatever the code (a cast never produces
inf; the inputs are left as they were). 6.1 is also checked inside a real fp16 training step;
6.4 inside FP8 runs on 4 spawned ranks (tensor, sequence and context parallelism), which must
equal the FP8 single device (float64: summation order only; chapters/06_fp8/demo.py's check_run).
"""

from __future__ import annotations

import pytest
import torch

from booktools.demo import import_chapter
from booktools.exercises import implementation, plugged
from differences import assert_equal, differs, show
from minimegatron.grad_scaler import DynamicGradScaler
from minimegatron.launch import spawn

ch06 = import_chapter("06")          # chapters/06_fp8/demo.py


# --------------------------------------------------------------------------------------
# 6.1 the dynamic loss scaler's update
# --------------------------------------------------------------------------------------
def _check_scales(events: str, want: list[float], why: str, **kwargs) -> None:
    """Feed `events` (x an overflow, . a clean step) to your update, from DynamicGradScaler(**kwargs);
    the scale after each step must be `want`. A failure names the first step that differs, the
    steps given, and your trackers after each step."""
    update = implementation("6.1")
    scaler = DynamicGradScaler(**kwargs)
    got, trackers = [], []
    for e in events:
        update(scaler, e == "x")
        got.append(scaler.scale)
        trackers.append((scaler.growth_tracker, scaler.hysteresis_tracker))
    if got != want:
        i = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
        settings = ", ".join(f"{k}={v}" for k, v in kwargs.items())
        raise AssertionError(differs(
            f"the scale after step {i + 1} ({'an overflow' if events[i] == 'x' else 'a clean step'})", got[i], want[i],
            given=f"the steps {events!r} (x an overflow, . a clean step) on DynamicGradScaler({settings})",
            why=f"{why}\n  every step's scale: got {got}, want {want}"
                f"\n  your (growth_tracker, hysteresis_tracker) after each step: {trackers}"))


@pytest.mark.exercise("6.1")
def test_overflows_back_off_after_the_hysteresis_and_clean_windows_grow():
    _check_scales("xxx...x...", [1024, 512, 256, 256, 256, 512, 512, 512, 512, 1024],
                  "x: 1 overflow left, no back-off (1024); x: 0 left, halve (512); x: still <= 0, halve (256); "
                  "...: three clean steps in a row double and refill both counters (512); x: refilled to 2, "
                  "1 left, no back-off; the third clean step after it doubles (1024)",
                  initial_scale=1024.0, min_scale=1.0, growth_interval=3, hysteresis=2)


@pytest.mark.exercise("6.1")
def test_clean_steps_do_not_refill_the_hysteresis():
    _check_scales("x..x", [64, 64, 64, 32],
                  "x: 1 overflow left; . .: clean, but not 4 in a row, so nothing is refilled; x: 0 left, halve",
                  initial_scale=64.0, min_scale=1.0, growth_interval=4, hysteresis=2)


@pytest.mark.exercise("6.1")
def test_the_scale_never_drops_below_its_minimum_and_an_overflow_restarts_the_window():
    _check_scales("xxxx", [4, 2, 2, 2], "hysteresis 1 halves at every overflow, but never below min_scale 2",
                  initial_scale=8.0, min_scale=2.0, growth_interval=2, hysteresis=1)
    _check_scales(".x..", [8, 8, 8, 16], "the overflow restarts the count of clean steps: window 2 grows only "
                  "after the last two", initial_scale=8.0, min_scale=1.0, growth_interval=2, hysteresis=3)


@pytest.mark.exercise("6.1")
def test_an_fp16_step_with_your_scaler_skips_and_halves_on_overflow():
    """A real fp16 optimizer step: its gradient made infinite, the step skipped, the scale your
    update gives (hysteresis 1: halved at once)."""
    import minimegatron.grad_scaler as grad_scaler
    from minimegatron.config import ModelConfig, TrainConfig
    from minimegatron.model import GPTModel
    from minimegatron.optim import Optimizer
    update = implementation("6.1")
    cfg = TrainConfig(lr_warmup_iters=0, fp16=True, initial_loss_scale=256.0, hysteresis=1)
    model = GPTModel(ModelConfig.llama(hidden_size=32, num_layers=1, num_attention_heads=4, max_position_embeddings=8,
                                       params_dtype="float16"))
    scaler = grad_scaler.build_grad_scaler(cfg)
    scaler.update = lambda found_inf: update(scaler, found_inf)
    optimizer = Optimizer([model], cfg, main_params_dtype=torch.float32, grad_scaler=scaler)
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.full_like(p, float("inf"))
    given = "an fp16 step whose every gradient is inf, initial_loss_scale 256, hysteresis 1"
    result = optimizer.step()
    assert_equal(result, None, "optimizer.step()'s return (None: the step was skipped)", given=given)
    assert_equal(scaler.scale, 128.0, "the loss scale after the skipped step", given=given,
                 why="hysteresis 1: the first overflow halves 256 at once")
    for (name, p), a in zip(model.named_parameters(), before):
        assert_equal(p, a, f"parameter {name} after the skipped step", given=given,
                     why="a skipped step changes no parameter")


# --------------------------------------------------------------------------------------
# 6.2 an FP8 cast with its scale and saturation
# --------------------------------------------------------------------------------------
def _check_cast(values: list[float], scale: float, fmt: str, want: list[float], why: str,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """cast(values, scale, fmt), read back as float32 numbers, must be `want`."""
    x = torch.tensor(values, dtype=dtype)
    out = implementation("6.2")(x, torch.tensor(scale), fmt)
    assert_equal(out.float().tolist(), want, f"the {fmt} values of the cast",
                 given=f"x = {show(x)}, scale {scale}, format {fmt!r}", why=why)
    return out


@pytest.mark.exercise("6.2")
def test_casts_round_to_the_nearest_fp8_number():
    _check_cast([0.2], 1.0, "e4m3", [0.203125], "0.2 = 1.6 x 2^-3: e4m3's neighbours are 1.5 and 1.625 x 2^-3; "
                "1.625 is the nearer")
    _check_cast([0.2], 1.0, "e5m2", [0.1875], "0.2 = 1.6 x 2^-3: e5m2's neighbours are 1.5 and 1.75 x 2^-3; "
                "1.5 is the nearer")
    # 100 = 1.5625 x 2^6 is e4m3's midpoint of 1.5 and 1.625: ties to the even mantissa, 1.5 = 0b100
    _check_cast([3.0, 100.0], 1.0, "e4m3", [3.0, 96.0], "3 = 1.5 x 2^1 is exact; 100 = 1.5625 x 2^6 is the "
                "midpoint of 1.5 and 1.625 x 2^6 and ties to the even mantissa 1.5: 96")
    _check_cast([3.0, 100.0], 1.0, "e5m2", [3.0, 96.0], "3 = 1.5 x 2^1 is exact; 100 = 1.5625 x 2^6 lies between "
                "e5m2's 1.5 and 1.75 x 2^6, nearer 1.5: 96")


@pytest.mark.exercise("6.2")
def test_the_scale_multiplies_before_the_cast_and_the_result_is_an_fp8_tensor():
    given = "x = [[0.01, -0.02], [0.005, 0.0]] in bfloat16, scale 22400, format 'e4m3'"
    out = _check_cast([[0.01, -0.02], [0.005, 0.0]], 22400.0, "e4m3", [[224.0, -448.0], [112.0, 0.0]],
                      "0.02 x 22400 = 448, e4m3's largest; bf16 0.01 is 0.010009765625, x 22400 = 224.22, and e4m3's "
                      "spacing at 2^7 is 16: 224", dtype=torch.bfloat16)
    assert_equal(out.dtype, torch.float8_e4m3fn, "the cast's dtype", given=given)
    assert_equal(tuple(out.shape), (2, 2), "the cast's shape", given=given)
    e5m2 = implementation("6.2")(torch.tensor([0.02]), torch.tensor(22400.0), "e5m2")
    assert_equal(e5m2.dtype, torch.float8_e5m2, "the cast's dtype", given="x = [0.02], scale 22400, format 'e5m2'")


@pytest.mark.exercise("6.2")
def test_values_beyond_the_format_saturate_never_overflow():
    big = [1e6, -1e6, float("inf")]
    _check_cast(big, 1.0, "e4m3", [448.0, -448.0, 448.0], "beyond e4m3's largest number, 448, the cast "
                "saturates to +-448")
    _check_cast(big, 1.0, "e5m2", [57344.0, -57344.0, 57344.0], "e5m2 has an inf, which a plain cast would give: "
                "clamp to +-57344, its largest finite number, before the cast")


# --------------------------------------------------------------------------------------
# 6.3 delayed scaling's amax-history update
# --------------------------------------------------------------------------------------
@pytest.mark.exercise("6.3")
def test_the_max_algo_reads_the_whole_history_and_the_history_rolls():
    update = implementation("6.3")
    history = torch.tensor([4.0, 0.0, 2.0])        # slot 0 the newest amax, 2 an older one
    scale = torch.tensor(1.0)
    given = "history [4.0, 0.0, 2.0] (slot 0 the newest), scale 1.0, fp8_max 448, margin 0, algo 'max'"
    new, rolled = update(history, scale, 448.0, 0, "max")
    assert_equal(new.item(), 112.0, "the new scale from history [4.0, 0.0, 2.0]", given=given,
                 why="max(4, 0, 2) = 4: 448 / 4 = 112")
    assert_equal(rolled.tolist(), [0.0, 2.0, 4.0], "the new history from history [4.0, 0.0, 2.0]", given=given,
                 why="rolled by one (slot 0 to the end, slot 1 to 0, ...), then slot 0 set to 0 for the next amax")
    assert_equal(history.tolist(), [4.0, 0.0, 2.0], "the history passed in, after the call", given=given,
                 why="the inputs must not be modified")
    assert_equal(scale.item(), 1.0, "the scale passed in, after the call", given=given,
                 why="the inputs must not be modified")
    assert_equal(new.dtype, torch.float32, "the new scale's dtype", given=given)


@pytest.mark.exercise("6.3")
def test_most_recent_and_the_margin():
    update = implementation("6.3")
    new, _ = update(torch.tensor([2.0, 8.0]), torch.tensor(1.0), 57344.0, 2, "most_recent")
    assert_equal(new.item(), 7168.0, "the new scale from history [2.0, 8.0]",
                 given="history [2.0, 8.0] (slot 0 the newest), scale 1.0, fp8_max 57344, margin 2, "
                       "algo 'most_recent'",
                 why="the most recent amax is slot 0's, 2; margin 2: 57344 / 2 / 2^2 = 7168")


@pytest.mark.exercise("6.3")
@pytest.mark.parametrize("amax", [0.0, float("inf"), float("nan")])
def test_a_zero_or_non_finite_amax_keeps_the_scale(amax):
    update = implementation("6.3")
    given = f"history [{amax}, 0.0] (slot 0 the newest), scale 3.5, fp8_max 448, margin 0, algo 'most_recent'"
    new, rolled = update(torch.tensor([amax, 0.0]), torch.tensor(3.5), 448.0, 0, "most_recent")
    assert_equal(new.item(), 3.5, f"the new scale from history [{amax}, 0.0]", given=given,
                 why=f"an amax of {amax} gives no usable scale: the old one stays")
    # compared as text: nan != nan
    assert_equal([str(x) for x in rolled.tolist()], ["0.0", str(amax)], f"the new history from history [{amax}, 0.0]",
                 given=given,
                 why="rolled by one like any other amax (it stays in the history), then slot 0 set to 0")


# --------------------------------------------------------------------------------------
# 6.4 spot the bug: the FP8 amax
# --------------------------------------------------------------------------------------
def _amaxes(parts: list) -> dict:
    """On each rank: its part of a tensor's amax through the exercise, over the whole world."""
    import torch.distributed as dist
    from minimegatron.comm import record_communication
    tensor_amax = implementation("6.4")
    with record_communication() as ledger:
        amax = tensor_amax(parts[dist.get_rank()], None, "fp8-amax")
    return {"amax": amax, "ledger": [(r.op, r.tag, r.nbytes) for r in ledger]}


@pytest.mark.exercise("6.4")
def test_every_rank_gets_the_whole_tensors_amax():
    parts = [torch.tensor([0.5, -3.0]), torch.tensor([[2.0, -7.5]], dtype=torch.float64)]   # the amax: 7.5
    given = ("tensor_amax(part, the world's group, 'fp8-amax') on 2 ranks: rank 0's part [0.5, -3.0] (float32), "
             "rank 1's [[2.0, -7.5]] (float64)")
    for rank, r in enumerate(spawn(_amaxes, 2, parts, timeout=120)):
        amax = r["amax"]
        assert_equal((amax.dtype, tuple(amax.shape)), (torch.float32, ()), f"rank {rank}'s amax (dtype, shape)",
                     given=given, why="one float32 number")
        assert_equal(amax.item(), 7.5, f"rank {rank}'s amax", given=given,
                     why="the parts' own amaxes are 3.0 and 7.5: every rank needs the whole tensor's, 7.5")
        assert_equal(r["ledger"], [("all_reduce", "fp8-amax", 4)], f"rank {rank}'s messages (op, tag, bytes)",
                     given=given, why="one all-reduce (max) of one float32 amax, tagged 'fp8-amax'")


@pytest.mark.exercise("6.4")
def test_fp8_runs_with_your_amax_equal_the_fp8_single_device():
    model = ch06.tiny_model("fp8")
    runs = [ch06.make_run(model, "fp8", tp=2, sp=True, dp=2, fp8_recipe="tensorwise", steps=2),
            ch06.make_run(model, "fp8", cp=4, fp8_recipe="tensorwise", steps=2),
            ch06.make_run(model, "fp8", tp=2, cp=2, fp8_recipe="tensorwise", steps=2)]
    per_rank = spawn(plugged(_train_runs, "6.4"), 4, runs, timeout=400)
    for i, run in enumerate(runs):
        report = ch06.check_run(run, [r[i] for r in per_rank])
        if not report.ok:
            first = report.problems[0] if report.problems else str(report.equivalence).splitlines()[0]
            raise AssertionError(
                f"{run.name()}, 2 steps, your tensor_amax inside: {first}\n"
                "  want: MATCH with the FP8 single device, within the tolerance [1/4] names, and the same losses "
                "on every rank\n" + "\n".join(report.lines + report.problems))


def _train_runs(runs):
    return [ch06.train_run(run) for run in runs]
