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
