"""Measured numbers that cannot go stale: each chapter's recorded run, and the text checked against it.

Every number a chapter measures or computes and its text quotes (README, notebook markdown,
figure captions) lives in one record per chapter, `chapters/NN_*/measured.json`, written by

    make numbers CH=04          # python -m booktools.measured record 04; then rewrite 04

which runs the chapter's recorded commands (the `RUNS` of its make_figures.py: its demos, and
make_figures.py itself, which redraws the figures), keeps their printouts and the dataclass each
run's main returns (booktools/capture.py), and asks the chapter's `measure(outputs, results)` for
the values the prose quotes: read from the results, or computed by the package's functions; the
printouts are what the text quotes as transcripts. The text points at the record in two ways,
both invisible once rendered:

    the demo prints 1,400,864<!--m:one_device_bytes--> bytes     # the number just before the marker
    <!--run:tp2-sp-->                                            # the fenced block that follows is
    ```                                                          # a printout of that run: every line
    [1/4] ...                                                    # is a line of the recorded output,
    ...                                                          # in order ("..." skips lines)
    ```

`python -m booktools.measured check` (and tests/test_measured.py) fails when a quoted number is
not the recorded value written at the precision and in the style the text chose (2.84, 1.4e-17,
1,400,864, 41{,}344), when a quoted line is not in the recorded printout, when a marker names
nothing, or when a fenced block that looks like a printout has no run marker. `rewrite` puts the
recorded values back into the text in the same style. Machine-dependent numbers (times,
throughput) are recorded like the rest but never claimed fixed: `same_printout` ignores them
when a test compares a fresh run with the record. A timing the prose quotes from
benchmarks/README.md (where it stands beside its command, machine and date) is marked
<!--bench-->, and must be there.

Two classes of numbers, decided per number:

- **Deterministic**: byte, parameter, message and call counts, shapes, formulas, settings
  (tolerances, learning rates), schedule simulations, and values computed from them. The same on
  every machine: the text quotes their digits (`<!--m:key-->`), and every check compares digits.
- **Round-off** (`RoundOff`): a number set by the order of floating-point operations, which
  the BLAS kernels, the vector width (ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS, MKL_CBWR)
  and the thread count choose. The max |diff| between a parallel run and one device (a zero
  among them: the two sums happened to round alike), which tensor holds that max, a float32
  difference in float32 code, a bf16/fp16 run's loss against fp32's. Like a time it differs
  from machine to machine (by a factor of 2 or more, since the max over a tensor can move to
  another element, and AdamW amplifies it). What such a number proves is a bound (below the
  tolerance, far below), and its size an order of magnitude. The text quotes it that way:

      below 1e-13<!--m<:key-->     # the recorded value is below the number
      about 1e-15<!--m~:key-->     # the recorded run's size: within a factor of 10 of the number

  A bound is a claim for any machine: the tolerance the run's MATCH enforces, or a power of ten
  at least MACHINE_FACTOR above the recorded value (what a fresh run is held to). Quoting a
  round-off value's digits (`<!--m:key-->`) is an error. A test computing it again, or rerunning
  a recorded command, compares it by order of magnitude (`same_magnitude`, within
  MACHINE_FACTOR) and against the tolerance its printout states, never by its digits.

By chapter: 00 and 02, all deterministic (counts, formulas; 02's float64 losses of one forward
pass, 8 digits at 1e-16 rounding). 01: eps_* round-off (which float32 gradient element AdamW
amplifies most, and by how much); the rest counts and bytes, its timelines times. 03, 04, 05:
*dloss, *dgrad, *dparam round-off; the rest bytes, counts, schedules. 06: loss_* and diff_*
round-off (300 steps of 16- and 32-bit training); q_* taken as deterministic to their digits
(statistics of FP8 casts over 10^5 values), and so is the loss-scale history (no gradient at
fp16's overflow edge in the recorded run); bytes deterministic. 07: pack_alone
and kernel_max_error round-off; timings machine-dependent; bytes and calls deterministic. 08:
reshard_loss, reshard_param round-off; the planner's numbers are formulas. Printouts follow
the same rule line by line (same_printout).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from booktools.capture import RESULTS
from booktools.demo import ROOT, import_chapter

RECORD_NAME = "measured.json"

# A number as the book writes one: 7, 2.84, -0.5, 1,400,864, 41{,}344 (LaTeX), 1.4e-17, 8.882e-16.
_NUMBER = re.compile(r"(?<![\w.{])(?P<sign>[-−])?(?P<int>\d{1,3}(?:(?:,|\{,\})\d{3})+|\d+)(?:\.(?P<frac>\d+))?"
                     r"(?:[eE](?P<exp>[-+−]?\d+))?(?![\d])")
_INLINE = re.compile(r"<!--m(?P<how>[<~]?):(?P<key>[\w.\-]+)-->")      # digits; below; about
_BENCH = re.compile(r"<!--bench-->")
_RUN = re.compile(r"^<!--run:(?P<run>[\w.\-]+)-->\s*$")
_FENCE = re.compile(r"^(```|~~~)")
_ELISION = {"...", "…", "⋮", "[...]"}
# A printout: the demos' section counters and verdicts, and the ledgers' "measured ... formula".
_LOOKS_LIKE_PRINTOUT = re.compile(r"^(\[\d+/\d+\]|MATCH|MISMATCH)|measured .* formula|max \|d")
# Lines whose numbers depend on the machine (time, throughput): compared by their words only.
MACHINE_DEPENDENT = re.compile(r"\d\s?(s|ms|min)\b(?![=\w])|tokens/s|it/s|s/it|elapsed|wall")
# A round-off figure in a printout: a number whose text since the previous number names an
# absolute difference, `max |diff| = 1.136e-15`, `max |dloss| 8.9e-16`, `largest |logit
# difference| 3e-16`, `largest difference 0.0011 x the tolerance`.
_ROUND_OFF_FIGURE = re.compile(r"\|[^|\d]+\||\bdifference\b")
# The bound a round-off figure's line states after it: `tolerance 1e-10`, `tol 1e-10`, or
# `rtol 1e-09, atol 1e-11` (torch.allclose's |a - b| <= atol + rtol |b|: atol + rtol for values
# up to 1 in size, which the demos' parameters and gradients are).
_SETTING = re.compile(r"\b(?:tolerance|tol|rtol|atol)\s*=?\s*$")     # a number these words name is a setting
_BOUND = re.compile(r"\b(?:tolerance|tol) (?P<tol>[\d.e+-]+)|\brtol (?P<rtol>[\d.e+-]+), atol (?P<atol>[\d.e+-]+)")
# On a line with round-off figures, the tensor named beside them is the one that holds the max:
# machine dependent too (decoder.layers.2.mlp.linear_fc1.weight here, the embedding there).
_TENSOR_NAME = re.compile(r"\b[A-Za-z_]\w*(?:\.\w+)+")
# How far a round-off figure may move between machines, either way. The max over a tensor is a
# few ulps at that tensor's scale, and kernels with another summation order give another few (the
# issue's AVX-512 machine: 1.1x to 2.5x the recorded values); AdamW then divides a gradient's
# round-off by sqrt(v) + eps, which amplifies it where a gradient is near zero (chapter 01, §9):
# ATEN_CPU_CAPABILITY=default moved chapter 04's parameter difference 11x (1.2e-15 to 1.3e-14,
# on another tensor). A factor of 100 holds them all, still 10^4 below float64's tolerances.
MACHINE_FACTOR = 100


class RoundOff(float):
    """A value set by the order of floating-point operations (see the module's docstring): a
    chapter's measure() returns it wrapped, `RoundOff(x)`; the record lists its key under
    "round_off"; the text quotes it as a bound or an order of magnitude."""


# ---------------------------------------------------------------------------------------------
# numbers in the book's style
# ---------------------------------------------------------------------------------------------
def parse_number(token: str) -> float:
    """The value of a number as the text writes it (thousands separators, unicode minus)."""
    return float(token.replace("{,}", "").replace(",", "").replace("−", "-"))


def format_like(token: str, value: float) -> str:
    """`value` written in the style of `token`: the same decimals (or significant digits in
    scientific notation), thousands separator and minus sign. format_like("2.84", 2.8371) ->
    "2.84"; format_like("1.4e-17", 1.38e-17) -> "1.4e-17"; format_like("41{,}344", 41344) -> "41{,}344"."""
    m = _NUMBER.fullmatch(token)
    if m is None:
        raise ValueError(f"{token!r} is not a number")
    decimals = len(m["frac"] or "")
    if m["exp"] is not None:
        mantissa, exponent = f"{value:.{decimals}e}".split("e")
        sign = "-" if int(exponent) < 0 else "+" if m["exp"].startswith("+") or int(exponent) == 0 else ""
        text = f"{mantissa}{'e' if 'e' in token else 'E'}{sign}{abs(int(exponent)):0{len(m['exp'].lstrip('+-−'))}d}"
    else:
        text = f"{value:,.{decimals}f}" if m["int"] != m["int"].replace(",", "") else f"{value:.{decimals}f}"
        text = text.replace(",", "{,}") if "{,}" in token else text
    return text.replace("-", "−") if "−" in token else text


def last_number(text: str) -> re.Match | None:
    """The last number in `text` (what an inline marker that follows it refers to)."""
    found = None
    for found in _NUMBER.finditer(text):
        pass
    return found


def numbers_of(line: str) -> list[str]:
    return [m.group(0) for m in _NUMBER.finditer(line)]


def round_off_figures(line: str) -> dict[int, float | None]:
    """The round-off figures of a printout line: {index among the line's numbers: the bound its
    line states after it, or None when it states none}."""
    figures, previous = {}, 0
    for j, m in enumerate(_NUMBER.finditer(line)):
        if _ROUND_OFF_FIGURE.search(line[previous:m.start()]):
            bound = _BOUND.search(line, m.end())
            figures[j] = (None if bound is None else parse_number(bound["tol"]) if bound["tol"] else
                          parse_number(bound["atol"]) + parse_number(bound["rtol"]))
        previous = m.end()
    return figures


def skeleton(line: str) -> str:
    """The line with every number replaced by '#' and runs of spaces by one (columns widen with
    their numbers), and on a line of round-off figures the tensor that holds the max by
    '<tensor>': what must not change between two runs."""
    if round_off_figures(line):
        line = _TENSOR_NAME.sub("<tensor>", line)
    return re.sub(r"\s+", " ", _NUMBER.sub("#", line.strip()))


def same_magnitude(recorded: float, now: float, factor: float = MACHINE_FACTOR) -> bool:
    """Two measurements of one round-off figure agree: both zero, or within `factor` of each
    other. A zero and a non-zero agree too: a zero is two sums that happened to round alike, and
    says nothing about the size of the round-off on another machine."""
    a, b = abs(recorded), abs(now)
    return a == 0 or b == 0 or max(a, b) <= factor * min(a, b)


def same_printout(recorded: list[str], fresh: list[str], rtol: float = 1e-3, noise: float = 1e-4,
                  machine: str | None = None) -> list[str]:
    """Differences between a recorded printout and a fresh run of the same command, one string
    each (empty: the same). The words must be the same; integers equal; round-off figures
    (`max |diff| = 1.1e-15`, see round_off_figures) below the bound their line states and of the
    recorded one's magnitude (same_magnitude), the tensor holding the max free to move; the
    tolerances a line states (`tol 1e-10`, `rtol 1e-09`) digit for digit; other numbers within
    rtol, or both below `noise`; numbers on machine-dependent lines (MACHINE_DEPENDENT, or the
    chapter's own pattern `machine`: a timing table's rows) are skipped."""
    timing = re.compile(MACHINE_DEPENDENT.pattern + (f"|{machine}" if machine else ""))
    problems = []
    if len(recorded) != len(fresh):
        problems.append(f"{len(recorded)} recorded lines, {len(fresh)} printed now")
    for i, (old, new) in enumerate(zip(recorded, fresh)):
        if skeleton(old) != skeleton(new):
            problems.append(f"line {i + 1}: recorded {old.strip()!r}, printed {new.strip()!r}")
            continue
        if timing.search(old):
            continue
        bounds, previous = round_off_figures(new), 0
        for j, (a, m) in enumerate(zip(numbers_of(old), _NUMBER.finditer(new))):
            b, setting, previous = m.group(0), _SETTING.search(new[previous:m.start()]), m.end()
            x, y = parse_number(a), parse_number(b)
            if setting and a != b:
                problems.append(f"line {i + 1}: {a} recorded, {b} printed now (a tolerance): {new.strip()!r}")
                break
            if j in bounds:
                bound = bounds[j]
                if bound is not None and abs(y) > bound:
                    problems.append(f"line {i + 1}: {b} is above its tolerance {bound:g}: {new.strip()!r}")
                    break
                if not same_magnitude(x, y) and not (bound is None and max(abs(x), abs(y)) < noise):
                    problems.append(f"line {i + 1}: {a} recorded, {b} printed now (round-off, but more than "
                                    f"{MACHINE_FACTOR}x apart): {new.strip()!r}")
                    break
                continue
            exact = "." not in a and "e" not in a.lower()
            close = x == y if exact else (abs(x - y) <= rtol * max(abs(x), abs(y)) or max(abs(x), abs(y)) < noise)
            if not close:
                problems.append(f"line {i + 1}: {a} recorded, {b} printed now: {new.strip()!r}")
                break
    return problems[:20]


# ---------------------------------------------------------------------------------------------
# the record of one chapter
# ---------------------------------------------------------------------------------------------
def chapter_dir(chapter: str) -> Path:
    found = sorted((ROOT / "chapters").glob(f"{chapter}_*"))
    if len(found) != 1:
        raise FileNotFoundError(f"chapter {chapter!r}: expected one folder chapters/{chapter}_*, found {found}")
    return found[0]


def chapters() -> list[str]:
    return sorted(p.name.split("_")[0] for p in (ROOT / "chapters").glob("[0-9][0-9]_*") if p.is_dir())


def load_record(chapter: str) -> dict:
    """The chapter's measured.json: {"runs": {id: {"command", "exit", "output": [lines]}},
    "values": {key: number}, "round_off": [the keys of values that are RoundOff], "recorded":
    date, "torch": version, "machine": description}. A record without "round_off" has none."""
    path = chapter_dir(chapter) / RECORD_NAME
    if not path.exists():
        return {"runs": {}, "values": {}}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path.relative_to(ROOT)} is not valid JSON ({e}): run `make numbers CH={chapter}`") from e


def save_record(chapter: str, record: dict) -> Path:
    """Written to a temporary name and renamed: a crash never leaves half a record."""
    path = chapter_dir(chapter) / RECORD_NAME
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path


def local_command(command: str, capture: bool = False) -> list[str]:
    """The argv that runs a command as the text writes it: `python` is this interpreter,
    `torchrun --standalone` the torchrun beside it bound to 127.0.0.1 on a free port. With
    `capture`, the script or module runs through booktools.capture, which keeps the dataclass
    its main returns (same printout, same exit status)."""
    argv = shlex.split(command)
    wrap = ["-m", "booktools.capture"] if capture else []
    if argv[0] == "python":
        return [sys.executable, *wrap, *argv[1:]]
    if argv[0] == "torchrun":
        rest = [a for a in argv[1:] if a != "--standalone"]
        if capture:                             # torchrun's own options, then the script or -m module
            i = next(i for i, a in enumerate(rest) if not a.startswith("--") or a == "-m")
            rest = [*rest[:i], "-m", "booktools.capture", *rest[i:]]
        return [str(Path(sys.executable).parent / "torchrun"), "--nnodes=1", "--rdzv-backend=c10d",
                "--rdzv-endpoint=127.0.0.1:0", "--local-addr=127.0.0.1", *rest]
    raise ValueError(f"a recorded command starts with python or torchrun, not {argv[0]!r}: {command}")


def run_command(command: str, timeout: float = 1800) -> dict:
    """Run one recorded command from the repository root (OMP_NUM_THREADS=1): its printout, its
    exit status, and `results`, the dataclass its main returned (booktools.capture), as JSON
    values (None for a main that returns only an exit status)."""
    with tempfile.TemporaryDirectory() as tmp:
        results_file = Path(tmp) / "results.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", RESULTS: str(results_file)}
        proc = subprocess.run(local_command(command, capture=True), cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=timeout)
        results = json.loads(results_file.read_text()) if results_file.exists() else None
    return {"command": command, "exit": proc.returncode, "output": proc.stdout.rstrip("\n").splitlines(),
            "results": results, "stderr_tail": proc.stderr[-2000:]}


def changed_values(recorded: dict, now: dict) -> dict:
    """{key: (recorded, computed now)} for each value of a chapter that measure() no longer
    computes: a deterministic one whose digits changed, a RoundOff one (measure() wraps it) of
    another magnitude (same_magnitude), or a key only one of them has."""
    changed = {}
    for key in set(recorded) | set(now):
        old, new = recorded.get(key), now.get(key)
        if old is None or new is None:
            changed[key] = (old, new)
        elif isinstance(new, RoundOff) and not same_magnitude(old, new) or not isinstance(new, RoundOff) and old != new:
            changed[key] = (old, new)
    return changed


def claim(holds: bool, sentence: str) -> None:
    """For a chapter's measure(): a sentence of its text that states a fact about the record in
    words ("exactly twice", "a quarter"); a ValueError naming it when the recorded runs no
    longer show it."""
    if not holds:
        raise ValueError(f"the chapter says {sentence!r}, which the recorded runs no longer show")


def measure_chapter(spec, runs: dict[str, dict]) -> dict:
    """A chapter's measure(outputs, results): each run's printout (a list of lines) and the
    values its main returned (booktools.capture; None for a run recorded without them)."""
    return spec.measure({run_id: r["output"] for run_id, r in runs.items()},
                        {run_id: r.get("results") for run_id, r in runs.items()})


def record_chapter(chapter: str, only: list[str] | None = None) -> dict:
    """Run the chapter's RUNS (all, or `only`: [] reruns none and recomputes the values from
    the recorded printouts), keep the rest of the old record, compute its values with
    measure(outputs, results) and save. A run that exits unlike its record's expectation
    (the spec's `EXPECTED_EXIT`, default 0) stops the recording with its stderr."""
    spec = import_chapter(chapter, "make_figures")
    runs: dict[str, str] = spec.RUNS
    expected_exit = getattr(spec, "EXPECTED_EXIT", {})
    record = load_record(chapter)
    for run_id in only or []:
        if run_id not in runs:
            raise KeyError(f"chapter {chapter} has no run {run_id!r}; its runs: {', '.join(runs)}")
    old_runs = record.get("runs", {})
    new_runs = {}
    for i, (run_id, command) in enumerate(runs.items()):
        if only is not None and run_id not in only and run_id in old_runs and old_runs[run_id]["command"] == command:
            new_runs[run_id] = old_runs[run_id]
            continue
        print(f"[{i + 1}/{len(runs)}] {run_id}: {command}", flush=True)
        start = time.perf_counter()
        result = run_command(command)
        if result["exit"] != expected_exit.get(run_id, 0):
            raise RuntimeError(f"chapter {chapter}, run {run_id} exited {result['exit']}:\n"
                               + "\n".join(result["output"][-20:]) + "\n" + result["stderr_tail"])
        del result["stderr_tail"]
        new_runs[run_id] = result
        print(f"      {len(result['output'])} lines in {time.perf_counter() - start:.0f} s", flush=True)
    record = {"chapter": chapter, "recorded": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
              "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "runs": new_runs, "values": record.get("values", {}), "round_off": record.get("round_off", [])}
    save_record(chapter, record)            # the printouts first: a failing measure() loses no run
    values = dict(sorted(measure_chapter(spec, new_runs).items()))
    record["values"] = {key: float(value) if isinstance(value, RoundOff) else value for key, value in values.items()}
    record["round_off"] = [key for key, value in values.items() if isinstance(value, RoundOff)]
    save_record(chapter, record)
    return record


# ---------------------------------------------------------------------------------------------
# the text: inline markers and quoted printouts
# ---------------------------------------------------------------------------------------------
def texts_of(chapter: str) -> dict[str, str]:
    """Every text of a chapter that quotes numbers, by a name to report: its README (figure
    captions included), each markdown cell of its notebook, and the files its make_figures.py
    lists in TEXTS (paths from the repository root: chapter 05's runs include `make demo`, which
    the book's front page quotes)."""
    folder = chapter_dir(chapter)
    texts = {str((folder / "README.md").relative_to(ROOT)): (folder / "README.md").read_text()}
    for extra in getattr(import_chapter(chapter, "make_figures"), "TEXTS", ()):
        texts[extra] = (ROOT / extra).read_text()
    for notebook in sorted((ROOT / "notebooks").glob(f"{chapter}_*.ipynb")):
        cells = json.loads(notebook.read_text())["cells"]
        for i, cell in enumerate(cells):
            if cell["cell_type"] == "markdown":
                texts[f"{notebook.relative_to(ROOT)} cell {i}"] = "".join(cell["source"])
    return texts


def _quoted_lines(lines: list[str], start: int) -> tuple[list[tuple[int, str]], int]:
    """The lines of the fenced block that opens at or after `start`: [(index, line)], end index."""
    i = start
    while i < len(lines) and not lines[i].strip():
        i += 1
    if i >= len(lines) or not _FENCE.match(lines[i]):
        return [], i
    fence = lines[i][:3]
    body, i = [], i + 1
    while i < len(lines) and not lines[i].startswith(fence):
        body.append((i, lines[i]))
        i += 1
    return body, i


def _match_printout(quoted: list[tuple[int, str]], output: list[str], command: str):
    """Walk the quoted lines through the recorded output in order: yields (index, line, the
    recorded line it is, or None when it is not there). '...' lines skip; a `$ command` line
    must be the run's command."""
    position = 0
    for index, line in quoted:
        text = line.rstrip()
        if text.strip() in _ELISION:
            yield index, line, line
            continue
        if text.startswith("$ "):
            yield index, line, (line if text[2:].strip() == command else None)
            continue
        try:
            found = output.index(text, position)
        except ValueError:
            same_words = [j for j in range(position, len(output)) if skeleton(output[j]) == skeleton(text)]
            if same_words:
                position = same_words[0] + 1
            yield index, line, ("changed", output[same_words[0]]) if same_words else None
            continue
        position = found + 1
        yield index, line, line


def check_text(name: str, text: str, record: dict, benchmarks: str = "") -> list[str]:
    """What in one text disagrees with the chapter's record, one message each (empty: nothing).
    A timing marked <!--bench--> must be one that `benchmarks` (benchmarks/README.md, where each
    machine-dependent number stands beside its command, machine and date) reports."""
    problems, values, runs = [], record.get("values", {}), record.get("runs", {})
    lines = text.splitlines()
    inside_fence, marked_blocks = False, set()
    for i, line in enumerate(lines):
        where = f"{name}:{i + 1}"
        run = _RUN.match(line)
        if run:
            quoted, end = _quoted_lines(lines, i + 1)
            marked_blocks.update(index for index, _ in quoted[:1])
            if not quoted:
                problems.append(f"{where}: <!--run:{run['run']}--> is not followed by a fenced block")
            elif run["run"] not in runs:
                problems.append(f"{where}: no recorded run {run['run']!r} (runs: {', '.join(runs) or 'none'})")
            else:
                recorded = runs[run["run"]]
                for index, quoted_line, match in _match_printout(quoted, recorded["output"], recorded["command"]):
                    if match is None:
                        problems.append(f"{name}:{index + 1}: not in run {run['run']}'s printout: {quoted_line.strip()!r}")
                    elif isinstance(match, tuple):
                        problems.append(f"{name}:{index + 1}: run {run['run']} printed {match[1].strip()!r}, "
                                        f"the text says {quoted_line.strip()!r}")
            continue
        if _FENCE.match(line):
            if not inside_fence:
                body, _ = _quoted_lines(lines, i)
                if i + 1 not in marked_blocks and body and any(_LOOKS_LIKE_PRINTOUT.search(b) for _, b in body):
                    problems.append(f"{where}: this fenced block looks like a printout but has no <!--run:...--> "
                                    f"line before it")
            inside_fence = not inside_fence
            continue
        cursor = 0
        for marker in (() if inside_fence else _BENCH.finditer(line)):
            number = last_number(_INLINE.sub("", line[:marker.start()]))
            if number is None or not re.search(rf"(?<![\d.]){re.escape(number.group(0))}(?!\.?\d)", benchmarks):
                problems.append(f"{where}: {number.group(0) if number else 'no number'} (<!--bench-->) is not "
                                f"in benchmarks/README.md")
        for marker in (() if inside_fence else _INLINE.finditer(line)):
            key, how = marker["key"], marker["how"]
            number, cursor = last_number(line[cursor:marker.start()]), marker.end()
            if key not in values:
                problems.append(f"{where}: {marker.group(0)} names no recorded value")
            elif number is None:
                problems.append(f"{where}: {marker.group(0)} has no number before it")
            elif how == "" and key in record.get("round_off", ()):
                problems.append(f"{where}: {key} = {values[key]!r} is round-off, its digits differ by machine: "
                                f"quote a bound, 'below N<!--m<:{key}-->', or its size, 'about N<!--m~:{key}-->'")
            elif how == "<" and not abs(values[key]) < parse_number(number.group(0)):
                problems.append(f"{where}: the text says below {number.group(0)}, the record {key} = {values[key]!r}")
            elif how == "~" and not (values[key] != 0 and same_magnitude(parse_number(number.group(0)), values[key], 10)):
                problems.append(f"{where}: the text says about {number.group(0)}, the record {key} = {values[key]!r} "
                                f"(more than 10x away)")
            elif how == "" and format_like(number.group(0), values[key]) != number.group(0):
                problems.append(f"{where}: the text says {number.group(0)}, the record {key} = {values[key]!r} "
                                f"({format_like(number.group(0), values[key])} at that precision)")
    return problems


def rewrite_text(text: str, record: dict) -> tuple[str, list[str]]:
    """The text with every marked number written from the record (in its own style) and every
    quoted printout line replaced by the recorded line with the same words; and what it could
    not place (a quoted line whose words the printout no longer has)."""
    values, runs = record.get("values", {}), record.get("runs", {})
    lines, unplaced = text.split("\n"), []
    for i, line in enumerate(lines):
        run = _RUN.match(line)
        if run and run["run"] in runs:
            quoted, _ = _quoted_lines(lines, i + 1)
            recorded = runs[run["run"]]
            for index, quoted_line, match in _match_printout(quoted, recorded["output"], recorded["command"]):
                if isinstance(match, tuple):
                    lines[index] = match[1]
                elif match is None:
                    unplaced.append(quoted_line.strip())
            continue
        pieces, cursor = [], 0
        for marker in _INLINE.finditer(line):
            head = line[cursor:marker.start()]                  # the text since the previous marker
            number = last_number(head)
            if marker["key"] in values and number is not None and not marker["how"]:   # a bound stays
                head = head[:number.start()] + format_like(number.group(0), values[marker["key"]]) + head[number.end():]
            pieces.append(head + marker.group(0))
            cursor = marker.end()
        lines[i] = "".join(pieces) + line[cursor:]
    return "\n".join(lines), unplaced


def check_chapter(chapter: str) -> list[str]:
    """Every disagreement between a chapter's texts and its record."""
    record, benchmarks = load_record(chapter), (ROOT / "benchmarks" / "README.md").read_text()
    return [problem for name, text in texts_of(chapter).items()
            for problem in check_text(name, text, record, benchmarks)]


def rewrite_chapter(chapter: str) -> list[str]:
    """Write the record's values into the chapter's README and notebook markdown; returns the
    quoted lines it could not place (to fix by hand)."""
    record, unplaced = load_record(chapter), []
    extras = [ROOT / extra for extra in getattr(import_chapter(chapter, "make_figures"), "TEXTS", ())]
    for readme in [chapter_dir(chapter) / "README.md", *extras]:
        text, missing = rewrite_text(readme.read_text(), record)
        readme.write_text(text)
        unplaced += [f"{readme.relative_to(ROOT)}: {line}" for line in missing]
    for notebook in sorted((ROOT / "notebooks").glob(f"{chapter}_*.ipynb")):
        nb = json.loads(notebook.read_text())
        for cell in nb["cells"]:
            if cell["cell_type"] == "markdown":
                text, missing = rewrite_text("".join(cell["source"]), record)
                cell["source"] = text.splitlines(keepends=True)
                unplaced += [f"{notebook.relative_to(ROOT)}: {line}" for line in missing]
        notebook.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    return unplaced


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m booktools.measured", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("check", "record", "rewrite"),
                        help="check: the texts against the records; record: rerun a chapter's RUNS and "
                             "rewrite its record (and figures); rewrite: put the record's numbers into the texts")
    parser.add_argument("chapters", nargs="*", help="chapter numbers (default: every chapter)")
    parser.add_argument("--only", nargs="*", metavar="RUN",
                        help="record: rerun only these runs of the chapter (none: recompute the values from the "
                             "recorded printouts)")
    args = parser.parse_args(argv)
    selected = args.chapters or chapters()
    failed = False
    for chapter in selected:
        if args.action == "record":
            record = record_chapter(chapter, args.only)
            print(f"chapter {chapter}: {len(record['runs'])} runs, {len(record['values'])} values recorded")
        if args.action in ("record", "rewrite"):
            for line in rewrite_chapter(chapter):
                print(f"chapter {chapter}: a quoted line no longer printed, fix it by hand: {line}")
                failed = True
        problems = check_chapter(chapter)
        print(f"chapter {chapter}: {'OK' if not problems else f'{len(problems)} problem(s)'}")
        for problem in problems:
            print(f"  {problem}")
        failed |= bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    # Run as the module the chapters import: under `python -m` this file is __main__, whose
    # RoundOff is another class than the one make_figures.py wraps its values in.
    from booktools import measured
    sys.exit(measured.main())
