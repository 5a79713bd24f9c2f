"""What a grader says when it fails: the quantity, what it got, what it wants, and the input.

    from differences import assert_close, assert_equal, differs

    assert_equal(new.item(), 112.0, "the new scale",
                 given="history [4.0, 0.0, 2.0], scale 1.0, fp8_max 448, margin 0, algo 'max'",
                 why="max(4, 0, 2) = 4: 448 / 4 = 112")

fails with

    the new scale: got 448.0, want 112.0
      given: history [4.0, 0.0, 2.0], scale 1.0, fp8_max 448, margin 0, algo 'max'
      why: max(4, 0, 2) = 4: 448 / 4 = 112

The first line is the one the summary table shows for a failing exercise (grading.first_difference),
so it names the quantity and both values; the input and the reason follow on their own lines.
(A module of its own, not the conftest: a grader imports it by name, tests/graders/ being on
sys.path, as it is in a spawned rank.)
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["show", "differs", "assert_equal", "assert_close"]


def show(value: Any) -> str:
    """A value as a message prints it: a small tensor as its list (6 significant digits; with its
    dtype when it is not float32, int64 or bool), a large one as torch's short repr, an int of
    five digits or more with commas; a string as it is (a description of the value)."""
    if isinstance(value, torch.Tensor):
        text = str(_short(value.tolist())) if value.numel() <= 16 else repr(value)
        return text if value.dtype in (torch.float32, torch.int64, torch.bool) else f"{text} ({value.dtype})"
    if isinstance(value, list):
        return str(_short(value))
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10_000:
        return f"{value:,}"
    return str(value)


def _short(x: Any) -> Any:
    """Floats in nested lists to 6 significant digits (0.203125 stays, 0.455627977848053 is 0.455628)."""
    if isinstance(x, list):
        return [_short(e) for e in x]
    return float(f"{x:.6g}") if isinstance(x, float) else x


def differs(quantity: str, got: Any, want: Any, given: str = "", why: str = "") -> str:
    """'<quantity>: got <got>, want <want>', then '  given: ...' and '  why: ...' when set."""
    lines = [f"{quantity}: got {show(got)}, want {show(want)}"]
    if given:
        lines.append(f"  given: {given}")
    if why:
        lines.append(f"  why: {why}")
    return "\n".join(lines)


def assert_equal(got: Any, want: Any, quantity: str, given: str = "", why: str = "") -> None:
    """got == want (torch.equal for tensors, which also compares shapes), else an AssertionError
    whose message is differs(...)."""
    __tracebackhide__ = True
    same = torch.equal(got, want) if isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor) else got == want
    if not same:
        raise AssertionError(differs(quantity, got, want, given, why))


def assert_close(got: torch.Tensor, want: torch.Tensor, quantity: str, given: str = "", why: str = "",
                 **tolerance: Any) -> None:
    """torch.testing.assert_close(got, want, **tolerance), its message led by the quantity (and
    the greatest difference), the input and the reason; torch's own lines (how many elements
    differ, the greatest difference and where) follow."""
    __tracebackhide__ = True

    def message(torch_says: str) -> str:
        head = f"{quantity} differs"
        if isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor) and got.shape == want.shape:
            far = (got.double() - want.double()).abs().nan_to_num(float("inf")).max().item() if got.numel() else 0.0
            head += f" by up to {far:.3g}"
        lines = [head]
        if given:
            lines.append(f"  given: {given}")
        if why:
            lines.append(f"  why: {why}")
        lines += ["  " + line for line in torch_says.splitlines() if line.strip()]
        return "\n".join(lines)
    torch.testing.assert_close(got, want, msg=message, **tolerance)
