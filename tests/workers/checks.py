"""Running many checks in one spawned world, so that one failing check does not hide the others."""


def run_named_checks(checks, *args) -> dict[str, str | None]:
    """Run every check(*args) and record None (passed) or its traceback, so that one failing
    check in a spawned world does not hide the others. Used inside ranks; see `rank_failures`."""
    import traceback

    results: dict[str, str | None] = {}
    for check in checks:
        try:
            check(*args)
            results[check.__name__] = None
        except Exception:
            results[check.__name__] = traceback.format_exc()
    return results


def rank_failures(per_rank: list[dict[str, str | None]], name: str) -> str:
    """The tracebacks of check `name` on every rank where it failed ("" when it passed everywhere)."""
    return "\n".join(f"--- rank {r} ---\n{res[name]}" for r, res in enumerate(per_rank) if res[name] is not None)


def run_exercise_checks(checks) -> dict[str, dict]:
    """Inside a rank of a grader's world: each exercise's check, {id: check()}, run with that
    exercise's function plugged in (booktools.exercises.plug: the learner's, the reference or
    the bare stub). Returns {id: {"error": traceback or None, "data": what the check returned}},
    so that one exercise's failure does not hide the others'; see `exercise_data`."""
    import traceback

    from booktools.exercises import plug

    out = {}
    for eid, check in checks.items():
        try:
            with plug(eid):
                out[eid] = {"error": None, "data": check()}
        except Exception:
            out[eid] = {"error": traceback.format_exc(), "data": None}
    return out


def exercise_data(world: list[dict], eid: str) -> list:
    """Every rank's data for exercise `eid` (run_exercise_checks' results gathered from the
    ranks), or an AssertionError with the tracebacks of the ranks where its checks stopped."""
    failed = [f"--- rank {r} ---\n{res[eid]['error']}" for r, res in enumerate(world) if res[eid]["error"]]
    if failed:
        raise AssertionError(f"exercise {eid}: the checks stopped on {len(failed)} of {len(world)} ranks:\n"
                             + "\n".join(failed))
    return [res[eid]["data"] for res in world]
