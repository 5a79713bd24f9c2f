"""What every chapter demo shares, written once: finding a chapter's module, its command line's
frame, the torchrun-or-spawn entry, and the verdict. A chapter's demo.py keeps only its
experiment (the run, what each rank records, the report):

    def main(argv=None) -> int:
        args = parse_args(argv)                            # demo_parser(...) + the chapter's flags
        return run_demo(args, "02", build_run, train_run, report, model_parallel=lambda a: {"tp": a.tp})

`run_demo` runs the experiment under torchrun (every rank trains, rank 0 reports, every rank
exits with rank 0's verdict) or, without torchrun, spawns the run's ranks itself and reports
in this process. A report prints what it found and returns its last line, which starts with
MATCH (exit 0) or MISMATCH (exit 1). A configuration that cannot run (a bad flag, a layout
that does not fit) is named before any rank trains, in the demo's own flags where the demo
checks it, and ends the program with exit 2: printed once, by this process or, under
torchrun, by rank 0 alone (`refuse_under_torchrun`), however many ranks torchrun started.

Notebooks, graders and make_figures.py reach a chapter's experiments with
`import_chapter("03")` (chapters/03_pp/demo.py as the module chapters.03_pp.demo), which spawned
ranks can import again by that name. This lives here, beside the exercise tools, because it is
the book's machinery: the package `minimegatron` never imports a chapter.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from minimegatron.config import ConfigError, ModelConfig, TrainConfig

ROOT = Path(__file__).resolve().parent.parent                 # the repository: minimegatron/, chapters/

__all__ = ["import_chapter", "Results", "Run", "DemoParser", "demo_parser", "add_training_flags", "check_at_least",
           "check_at_least_one", "check_sequence_length", "model_line", "largest_differences", "verdict_line",
           "busiest_rank_communication", "data_parallel_size_under_torchrun", "refuse_under_torchrun", "verdict_under_torchrun", "run_demo",
           "communication_report"]


def import_chapter(number: str, module: str = "demo"):
    """The module chapters/<number>_*/<module>.py, imported as chapters.<folder>.<module> (e.g.
    import_chapter("00") -> chapters.00_single_device.demo). The repository root goes on sys.path
    if it is not there; chapters/ and its folders have no __init__.py (namespace packages).
    Because the module has a real dotted name, a function defined in it can be sent to
    minimegatron.launch.spawn. FileNotFoundError when no (or more than one) folder matches."""
    folders = sorted(p.parent.name for p in (ROOT / "chapters").glob(f"{number}_*/{module}.py"))
    if len(folders) != 1:
        raise FileNotFoundError(f"chapter {number!r}: expected one chapters/{number}_*/{module}.py under {ROOT}, "
                                f"found {folders}")
    if not any(Path(p or ".").resolve() == ROOT for p in sys.path):
        sys.path.insert(0, str(ROOT))
    return importlib.import_module(f"chapters.{folders[0]}.{module}")


@dataclass
class Results:
    """What a demo measured, returned by its main as well as printed (booktools/capture.py keeps
    it beside the printout, and a chapter's measure() reads its numbers from it): `exit_code`,
    0 for MATCH, 1 for MISMATCH, 2 for a configuration refused before any rank trained, and
    `verdict`, the last line printed; `seconds`, the ranks' training time run_demo printed first
    (machine-dependent). A chapter's results (TPResults, ...) add the values its report printed,
    as plain numbers, strings, lists and dicts (JSON)."""
    exit_code: int = 0
    verdict: str = ""
    seconds: float | None = None


@dataclass(frozen=True)
class Run:
    """One training run of a chapter demo: `model` trained on tp x cp x pp x dp ranks as `train`
    says (its tensor / context / pipeline sizes, grad_accum_steps micro-batches of
    micro_batch_size rows, train_iters steps: the training loop's own fields), dp data-parallel
    replicas; seed: the random token batches. A chapter's run (TPRun, PPRun, ...) adds its name."""
    model: ModelConfig
    train: TrainConfig
    dp: int
    seed: int = 0

    tp = property(lambda self: self.train.tensor_model_parallel_size)
    cp = property(lambda self: self.train.context_parallel_size)
    pp = property(lambda self: self.train.pipeline_model_parallel_size)
    sp = property(lambda self: self.train.sequence_parallel)
    world = property(lambda self: self.tp * self.cp * self.pp * self.dp)
    micro_batches = property(lambda self: self.train.grad_accum_steps)

    def global_batches(self) -> list[dict[str, torch.Tensor]]:
        """One global batch of micro_batch_size x micro-batches x dp sequences per step: what the
        single device sees (testing.global_batches)."""
        from minimegatron.testing import global_batches
        return global_batches(self.model, self.train, self.dp, self.seed)


class DemoParser(argparse.ArgumentParser):
    """argparse's parser, whose errors are printed once under torchrun: every rank parses the
    same command line and finds the same error, so rank 0 alone prints the usage and the
    error, and every rank exits 2 (refuse_under_torchrun). Without torchrun: argparse's own."""

    def error(self, message: str):
        if "RANK" not in os.environ:
            super().error(message)                     # prints usage and message, exits 2
        error = f"{self.prog}: error: {message}"
        sys.exit(refuse_under_torchrun(self.format_usage() + error, root_cause=error))


def demo_parser(chapter: str, description: str) -> DemoParser:
    """The parser of chapters/<chapter>_*/demo.py, with the verdict's promise as its epilog."""
    folder = next((ROOT / "chapters").glob(f"{chapter}_*")).name
    return DemoParser(prog=f"chapters/{folder}/demo.py", description=description,
                      epilog="Ends with a line starting MATCH (exit 0) or MISMATCH (exit 1).")


def add_training_flags(parser: argparse.ArgumentParser, *, style: str = "llama", micro_batches: int = 2,
                       micro_batch_size: bool = True) -> None:
    """The flags every distributed demo shares: --micro-batches (per step and data-parallel rank;
    the first M-1 inside no_sync()), --micro-batch-size (if asked), --steps, --dtype, --style
    (default `style`) and --quick."""
    parser.add_argument("--micro-batches", type=int, default=micro_batches,
                        help=f"M micro-batches per step and data-parallel rank; the first M-1 run inside no_sync() "
                             f"(default {micro_batches})")
    if micro_batch_size:
        parser.add_argument("--micro-batch-size", type=int, default=2, help="b sequences per micro-batch (default 2)")
    parser.add_argument("--steps", type=int, default=None, help="AdamW steps (default 3, or 2 with --quick)")
    parser.add_argument("--dtype", choices=["float64", "float32"], default="float64",
                        help="float64 (tight tolerances, the default) or float32 (AdamW eps 1e-5)")
    parser.add_argument("--style", choices=["llama", "gpt2"], default=style, help=f"model style (default {style})")
    parser.add_argument("--quick", action="store_true", help="a smaller run of 2 steps (what the tests run)")


def model_line(cfg: ModelConfig, detail: str = "") -> str:
    """One line describing a demo's model: norm/activation, sizes, parameters, dtype."""
    from minimegatron.analysis import count_parameters
    return (f"model: {cfg.normalization}/{cfg.activation}, h={cfg.hidden_size} L={cfg.num_layers}{detail} "
            f"a={cfg.num_attention_heads} g={cfg.query_groups} V={cfg.vocab_size}, "
            f"{count_parameters(cfg)['total']:,} parameters, {cfg.params_dtype}"
            + ("" if cfg.untie_embeddings_and_output_weights else ", tied embeddings"))


def check_at_least(parser: argparse.ArgumentParser, args: argparse.Namespace, minimum: int,
                   *names: str) -> argparse.Namespace:
    """parser.error for the first flag among `names` that was given (not None) below `minimum`;
    returns args. A value the demo would replace by its default (0 in `args.steps or 3`) is
    refused here, never silently swapped."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < minimum:
            parser.error(f"--{name.replace('_', '-')}={value} must be at least {minimum}")
    return args


def check_at_least_one(parser: argparse.ArgumentParser, args: argparse.Namespace, *names: str) -> argparse.Namespace:
    """check_at_least(parser, args, 1, *names): sizes, counts, steps, lengths."""
    return check_at_least(parser, args, 1, *names)


def check_sequence_length(seq: int, *, cp: int = 1, tp: int = 1, sp: bool = False, max_positions: int,
                          given: bool = True) -> None:
    """ConfigError, in the demos' flags, unless a sequence of `seq` tokens can be cut as the
    run needs: under context parallelism into 2 cp equal chunks (cp/layout.py), under sequence
    parallelism each rank's s / cp tokens again into tp parts, and no longer than the model's
    max_positions. The message names a --seq that works (the longest one up to `seq`, else the
    shortest), or says that none fits the model. given: the learner typed --seq (else `seq` is
    the demo's default, and the message says so)."""
    needs = []                                          # (the sequence must be a multiple of, why)
    if cp > 1:
        needs.append((2 * cp, f"--cp {cp} cuts every sequence into 2 x {cp} = {2 * cp} equal chunks"))
    if sp and tp > 1:
        needs.append((cp * tp, f"--sp cuts each rank's s / {cp} tokens into --tp {tp} parts" if cp > 1
                      else f"--sp cuts the sequence into --tp {tp} parts"))
    multiple = math.lcm(*(m for m, _ in needs)) if needs else 1
    if seq <= max_positions and seq % multiple == 0:
        return
    what = f"--seq {seq}" if given else f"the default sequence length {seq}"
    problem = [f"longer than the model's {max_positions} positions"] if seq > max_positions else []
    if seq % multiple:
        problem.append("; ".join(why for _, why in needs) + f", so the sequence must be a multiple of {multiple}")
    works = (min(seq, max_positions) // multiple) * multiple or multiple
    if works > max_positions:
        raise ConfigError(f"{what}: {'; '.join(problem)}, and no multiple of {multiple} fits the model's "
                          f"{max_positions} positions; use a smaller --cp" + (" or --tp" if sp and tp > 1 else ""))
    raise ConfigError(f"{what}: {'; '.join(problem)}; --seq {works} works")


def largest_differences(equivalences) -> str:
    """The largest loss, gradient and parameter differences of testing.EquivalenceReport's, with
    the tolerance, in one line."""
    worst = {k: max(getattr(e, k) for e in equivalences) for k in ("max_loss_diff", "max_grad_diff", "max_param_diff")}
    tol = equivalences[0].tolerance
    return (f"max |dloss| {worst['max_loss_diff']:.1e} (tol {tol.loss:.0e}), max |dgrad| {worst['max_grad_diff']:.1e}, "
            f"max |dparam| {worst['max_param_diff']:.1e} (rtol {tol.parameters_rtol:.0e}, atol {tol.parameters_atol:.0e})")


def verdict_line(reports, name: Callable, claim: str) -> str:
    """A demo's last line from its reports (each with .ok, .equivalence and .problems): "MATCH:
    <names> equal the single-device run: <differences>; <claim>", or "MISMATCH: <why>; <differences>"
    naming every report that failed and its first problem."""
    diffs = largest_differences([r.equivalence for r in reports])
    bad = [r for r in reports if not r.ok]
    if bad:
        why = "; ".join(f"{name(r)}: " + (r.problems[0] if r.problems else "differs from the single-device run")
                        for r in bad)
        return f"MISMATCH: {why}; {diffs}"
    return f"MATCH: {', '.join(name(r) for r in reports)} equal the single-device run: {diffs}; {claim}"


def busiest_rank_communication(per_rank: list[dict]) -> dict[str, dict[str, int]]:
    """{dimension: {"calls", "bytes"}} for each dimension any rank recorded: one step's calls and
    bytes of the rank that hands the most bytes to that dimension (each rank's record has
    "records" by dimension, {(op, tag, bytes): count})."""
    busiest = {}
    for dim in sorted({d for r in per_rank for d in r["records"]}):
        calls = max((r["records"].get(dim, {}) for r in per_rank),
                    key=lambda c: sum(b * n for (_, _, b), n in c.items()))
        busiest[dim] = {"calls": sum(calls.values()), "bytes": sum(b * n for (_, _, b), n in calls.items())}
    return busiest


def communication_report(model_cfg: ModelConfig, cfg: TrainConfig, per_rank: list[dict]) -> tuple[list[str], list[str]]:
    """(lines, problems): one step's communication per dimension on the busiest rank
    (busiest_rank_communication), each dimension checked on every rank against
    analysis.step_communication (run_report.communication_checks; each rank's record has
    "records" by dimension, "pp_rank" and "ep_group")."""
    from minimegatron.run_report import communication_checks
    found, lines, problems = communication_checks(model_cfg, cfg, per_rank), [], []
    busiest = busiest_rank_communication(per_rank)
    for dim in sorted(set(busiest) | {d for d, here in found.items() if here}):
        row = busiest.get(dim, {"calls": 0, "bytes": 0})
        verdict = "no formula" if dim in ("loss and norm", "other") else (
            f"DIFFERS: {found[dim][0]}" if found.get(dim) else "= formula on every rank")
        lines.append(f"  {dim:<14}{row['calls']:>5} calls {row['bytes']:>10,} bytes  {verdict}")
        problems += [f"{dim}: {p}" for p in found.get(dim, [])]
    return lines, problems


def data_parallel_size_under_torchrun(world: int, sizes: dict[str, int], dp: int | None) -> int:
    """The data-parallel size of a chapter demo started by torchrun with `world` ranks, whose
    model-parallel sizes are `sizes` (e.g. {"tp": 2, "pp": 2}, in the demo's flag order): world
    divided by their product, or `dp` when that was given and the product times dp is the world.
    ConfigError naming which flags must divide or equal the number of ranks when they do not fit."""
    product = math.prod(sizes.values())
    if world % product == 0 and (dp is None or product * dp == world):
        return world // product
    flags = " x ".join(f"--{name} {size}" for name, size in sizes.items())
    names = " x ".join(sizes)
    if dp is None:
        need = f"{flags} = {product} must divide the number of ranks {world} (dp = ranks / ({names}))"
    else:
        need = f"{flags} x --dp {dp} = {product * dp} must equal the number of ranks {world}"
    raise ConfigError(f"{need}; use --nproc_per_node to set the number of ranks")


def refuse_under_torchrun(message: str, root_cause: str | None = None) -> int:
    """The end of a torchrun job whose configuration cannot run, on every rank; returns 2, the
    status every rank exits with.

    Every rank finds the same error (they parse the same flags and build the same run), so
    only rank 0 prints `message`: once per job, not once per rank run together on one line.
    Every rank writes `root_cause` (default: the message) to the file torchrun gives it for the
    reason it failed (TORCHELASTIC_ERROR_FILE), so that torchrun's closing summary names it
    under "Root Cause" instead of a link to its documentation, whichever rank torchrun sees
    exit first (rank 0 alone writing it made the summary depend on which rank won that race).
    Then every rank leaves through
    launch.finish_torchrun, whose barrier keeps the other ranks from exiting before rank 0 has
    printed (torchrun stops the whole job when the first rank exits non-zero).

    What the book does not control: torchrun itself exits 1 when a rank fails, prints a
    traceback of its own and a paragraph per failed rank after our message, and stops the ranks
    still running when the first one exits (one may be listed as ended by SIGTERM, -15)."""
    from minimegatron.launch import finish_torchrun, init_from_torchrun

    rank, _ = init_from_torchrun()
    if rank == 0:
        print(message, file=sys.stderr, flush=True)
    _tell_torchrun(root_cause or message)
    return finish_torchrun(2)


def _tell_torchrun(message: str) -> None:
    """Write `message` as this rank's error record in torchrun's JSON format (the one
    torch.distributed.elastic's ErrorHandler writes: a message and its "py_callstack", which
    torchrun's summary prints; here the message itself, not a traceback). Nothing when torchrun
    gave no file, or the file cannot be written: printing the message was the main thing."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    record = {"message": {"message": message, "extraInfo": {"py_callstack": message,
                                                            "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(record, f)
    except OSError:
        pass


def verdict_under_torchrun(result, report: Callable[[list], Results]) -> Results:
    """The end of a chapter demo under torchrun, on every rank: gather every rank's `result`
    on rank 0 (torch.distributed.gather_object: plumbing for the report, in no ledger), call
    `report(per_rank)` there (it prints, and returns the Results; a report that raises prints
    its traceback and counts as MISMATCH, 1), broadcast rank 0's exit code to every rank, leave
    the job with launch.finish_torchrun (the one teardown of every torchrun entry: it frees
    every process group and its gloo threads before Python shuts down) and return the Results
    (rank 0's; on the other ranks, the exit code alone): every rank exits with rank 0's verdict."""
    import torch.distributed as dist

    from booktools.capture import keep
    from minimegatron import comm
    from minimegatron.launch import finish_torchrun

    rank = dist.get_rank()
    gathered = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(result, gathered, dst=0)
    results = Results()
    if rank == 0:
        try:
            results = report(gathered)
        except Exception:                               # still tell the other ranks
            traceback.print_exc()
            print("MISMATCH: the report failed (traceback above)")
            results = Results(1, "MISMATCH: the report failed (traceback above)")
    verdict = torch.tensor([results.exit_code])
    comm.broadcast(verdict, 0, None, tag="verdict")
    keep(results)                                       # finish_torchrun may leave by os._exit
    results.exit_code = finish_torchrun(int(verdict.item()))
    return results


def run_demo(args: argparse.Namespace, chapter: str, build: Callable, train: Callable, report: Callable, *,
             model_parallel: Callable[[argparse.Namespace], dict[str, int]] = lambda args: {},
             spawn_dp: Callable[[argparse.Namespace], int] = lambda args: args.dp or 1) -> Results:
    """The main of a chapter demo; returns its Results (`exit_code` is the exit status).

    build(args, dp) -> the run (with .world, its ranks, and .name()); a configuration that cannot
        run raises ConfigError or ValueError here, before any rank trains: printed once as
        "error: ...", exit 2 (under torchrun: refuse_under_torchrun). An error after build is
        not a configuration error and is raised as it is.
    train(run) -> this rank's record, on every rank (a top-level function: spawned ranks import it).
    report(args, run, per_rank) -> the chapter's Results, after printing what it checked (its
        `verdict`, the last line, starts with MATCH or MISMATCH; a bare verdict string is taken
        as Results without values).
    Under torchrun (RANK set) dp = ranks / the product of model_parallel(args) (or args.dp when
    it fits); otherwise this process spawns run.world ranks with dp = spawn_dp(args)."""
    from minimegatron.launch import init_from_torchrun, spawn

    torch.set_num_threads(1)
    if "RANK" in os.environ:
        _, world = init_from_torchrun()
        try:
            run = build(args, data_parallel_size_under_torchrun(world, model_parallel(args), vars(args).get("dp")))
        except ValueError as exc:                      # ConfigError is one
            return Results(refuse_under_torchrun(f"error: {exc}"), f"error: {exc}")
        start = time.perf_counter()
        return verdict_under_torchrun(train(run), lambda per_rank: _report(
            chapter, report, args, run, per_rank, "torchrun", time.perf_counter() - start))
    try:
        run = build(args, spawn_dp(args))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return Results(2, f"error: {exc}")
    start = time.perf_counter()
    per_rank = spawn(train, run.world, run, timeout=600)
    return _report(chapter, report, args, run, per_rank, "spawned by this script; torchrun works too",
                   time.perf_counter() - start)


def _report(chapter, report, args, run, per_rank, how: str, seconds: float) -> Results:
    print(f"Chapter {chapter}: {run.name()} = {run.world} rank(s) ({how}), trained in {seconds:.1f} s")
    results = report(args, run, per_rank)
    if isinstance(results, str):
        results = Results(verdict=results)
    print()
    print(results.verdict)
    results.exit_code = 0 if results.verdict.startswith("MATCH") else 1
    results.seconds = round(seconds, 1)                 # as printed above
    return results
