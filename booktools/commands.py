"""Every command the book prints, found in its text and run as printed (tests/test_commands.py).

Where a command is (the extraction rule), in README.md, chapters/*/README.md and the markdown
cells of notebooks/*.ipynb:

- in a fenced block tagged ```bash, ```sh or ```shell, every line is a command, except blank
  lines and lines that start with `#` (a comment, or `#SBATCH`); a line ending in `\\` goes on
  on the next line;
- in any fenced block, a line that starts with `$ ` is a command (what follows the prompt); the
  lines after it up to the next `$ ` are its printout (```console style);
- an untagged fenced block with a line that starts like a command (python, torchrun, make, ...)
  and no `$ ` is an error to fix in the text: tag the block ```bash, or prompt the line with `$ `.
  Text in single backticks inside a paragraph is not a printed command.

How each runs is said by invisible markers on the lines just before the block (with its
<!--run:...--> marker, if it has one), one per line:

    <!--cmd long: make demo, make capstone-->            over 30 s: only `make check-commands`
    <!--cmd not-run (needs an NVIDIA GPU): make gpu-check-->   never run here; the reason is required
    <!--cmd exit 1 (the stubs are unfilled): --impl=learner-->  runs, and must exit with that status

The words after the colon, comma-separated, pick the block's commands: the command they are
(its comment aside), or else every command that contains them; each must pick at least one. A marker without a colon applies to every command of the block. An
unmarked command must exit 0.

How they run (`run_source`): every command of one text in the order printed, in one fresh
temporary directory that holds a copy of the repository's files (`git ls-files`, so nothing the
repository ignores: no runs/, no build/) and a link to its .venv. A copy, not links: the book's
modules find the repository from their own resolved path (booktools/demo.py ROOT), so a
linked tree would write into the repository itself (`booktools.exercises generate --force`
does). `python` and `torchrun` become this interpreter and the torchrun beside it
(`booktools.measured.local_command`, as the recorded runs do); any other command (`make`,
`source`, `export`) runs in bash. OMP_NUM_THREADS=1, as the quick start exports.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from booktools.demo import ROOT
from booktools.measured import local_command

SHELL_TAGS = {"bash", "sh", "shell"}
_FENCE = re.compile(r"^\s*(```|~~~)\s*(?P<tag>[\w+-]*)")
_MARKER = re.compile(r"^<!--cmd (?P<kind>long|not-run|exit (?P<code>\d+))(?: \((?P<reason>[^)]*)\))?"
                     r"(?::(?P<picks>.*))?-->\s*$")
_ANY_COMMENT = re.compile(r"^<!--.*-->\s*$")
_LOOKS_LIKE_A_COMMAND = re.compile(r"^\s*(python3?|torchrun|make|srun|pip|source|export|bash)\s")
SHORT_LIMIT_S = 30        # a command that takes longer is marked long (measured on 2 cores, benchmarks/)
HANG_GUARD_S = {"short": 180, "long": 3600}     # not speed tests: a hung command fails, it does not block CI


@dataclass
class Command:
    """One printed command. `where` is `path:line` (notebooks: `path cell N line M`, 1-based);
    `text` is as printed, continuation lines joined, the `$ ` prompt removed; `kind` is
    short (the test runs it), long (make check-commands runs it) or not-run; `exit` the status it
    must end with."""
    where: str
    text: str
    kind: str = "short"
    reason: str = ""
    exit: int = 0


@dataclass
class Source:
    """One text: its commands in the order printed, and what is wrong with its markup."""
    name: str
    commands: list[Command] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def _blocks(lines: list[str]):
    """Each fenced block: (index of its opening fence, tag, [(index, line)] of its body)."""
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, start, body = m.group(1), i, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append((i, lines[i]))
            i += 1
        yield start, m["tag"].lower(), body
        i += 1


def _markers_before(lines: list[str], start: int) -> list[tuple[int, re.Match | None]]:
    """The <!--cmd ...--> lines among the comment and blank lines just above line `start`:
    (index, match, or None for a <!--cmd line that does not parse)."""
    found, i = [], start - 1
    while i >= 0 and (not lines[i].strip() or _ANY_COMMENT.match(lines[i].strip())):
        if lines[i].strip().startswith("<!--cmd"):
            found.append((i, _MARKER.match(lines[i].strip())))
        i -= 1
    return found[::-1]


def _commands_of_block(tag: str, body: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """(index of its first line, text) for every command of one block (the extraction rule)."""
    commands, pending, first = [], "", None
    prompted = any(line.lstrip().startswith("$ ") for _, line in body)
    for index, line in body:
        if pending:                                     # a continuation line
            pending += " " + line.strip()
        elif prompted:
            if not line.lstrip().startswith("$ "):
                continue
            first, pending = index, line.lstrip()[2:].strip()
        elif tag in SHELL_TAGS:
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            first, pending = index, line.strip()
        else:
            continue
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        commands.append((first, pending))
        pending = ""
    if pending:
        commands.append((first, pending))
    return commands


def _without_comment(text: str) -> str:
    """A command without its trailing `# ...` comment and outer spaces."""
    return re.sub(r"\s+#\s.*$", "", text).strip()


def parse_text(name: str, text: str, line_name=lambda i: f"line {i + 1}") -> Source:
    """The commands of one markdown text and the problems of its markup (see the module doc)."""
    source, lines = Source(name), text.splitlines()
    for start, tag, body in _blocks(lines):
        found = _commands_of_block(tag, body)
        if not found and tag not in SHELL_TAGS:
            looks = [line for _, line in body if _LOOKS_LIKE_A_COMMAND.match(line)]
            if looks:
                source.problems.append(f"{name} {line_name(start)}: this block holds a command "
                                       f"({looks[0].strip()[:60]!r}) but is not tagged ```bash and has no `$ ` prompt")
        commands = [Command(f"{name} {line_name(i)}", t) for i, t in found]
        for index, marker in _markers_before(lines, start):
            where = f"{name} {line_name(index)}"
            if marker is None:
                source.problems.append(f"{where}: a <!--cmd ...--> marker that does not parse: {lines[index].strip()!r} "
                                       "(<!--cmd long|not-run (reason)|exit N (reason)[: picks]-->)")
                continue
            kind = "exit" if marker["code"] else marker["kind"]
            if kind != "long" and not (marker["reason"] or "").strip():
                source.problems.append(f"{where}: <!--cmd {marker['kind']}--> needs a reason in parentheses")
            picks = [p.strip() for p in marker["picks"].split(",")] if marker["picks"] is not None else [""]
            for pick in picks:
                chosen = ([c for c in commands if _without_comment(c.text) == pick] or
                          [c for c in commands if pick in c.text])
                if not chosen:
                    source.problems.append(f"{where}: {pick!r} picks no command of the block below it")
                for c in chosen:
                    if kind == "exit":
                        c.exit, c.reason = int(marker["code"]), marker["reason"] or ""
                    else:
                        c.kind, c.reason = kind, marker["reason"] or c.reason
        source.commands += commands
    return source


def book_sources(root: Path = ROOT) -> list[Source]:
    """README.md, chapters/*/README.md, then each notebook's markdown cells, in that order."""
    sources = [parse_text("README.md", (root / "README.md").read_text())]
    for readme in sorted(root.glob("chapters/*/README.md")):
        sources.append(parse_text(str(readme.relative_to(root)), readme.read_text()))
    for notebook in sorted(root.glob("notebooks/*.ipynb")):
        name, merged = str(notebook.relative_to(root)), Source(str(notebook.relative_to(root)))
        for n, cell in enumerate(json.loads(notebook.read_text())["cells"]):
            if cell["cell_type"] == "markdown":
                part = parse_text(name, "".join(cell["source"]), lambda i, n=n: f"cell {n} line {i + 1}")
                merged.commands += part.commands
                merged.problems += part.problems
        sources.append(merged)
    return sources


def fresh_copy(root: Path = ROOT) -> Path:
    """A new temporary directory holding the repository's files as git lists them (tracked, and
    new files not ignored; modification times kept, so make finds .venv up to date) and a link
    to its .venv."""
    target = Path(tempfile.mkdtemp(prefix="book-commands-"))
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    for relative in filter(None, listed):
        path = root / relative
        if path.is_file() and not path.is_symlink():
            (target / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target / relative)
    (target / ".venv").symlink_to(root / ".venv")
    return target


def argv_of(text: str) -> list[str]:
    """How a printed command runs: `python`/`torchrun` through booktools.measured.local_command,
    anything else through bash."""
    words = shlex.split(text, comments=True)
    if words and words[0] in ("python", "torchrun"):
        return local_command(shlex.join(words))
    return ["bash", "-c", text]


@dataclass
class Result:
    command: Command
    returncode: int | None          # None: not run
    seconds: float = 0.0            # wall clock
    cpu_seconds: float = 0.0        # user + system of the command and the processes it waited for
    output: str = ""


def run_command(command: Command, cwd: Path) -> Result:
    """Run one command in `cwd` under its kind's hang guard; its status, time and output tail."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    start, cpu_start = time.perf_counter(), _children_cpu()
    try:
        proc = subprocess.run(argv_of(command.text), cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=HANG_GUARD_S[command.kind], start_new_session=True)
        code, output = proc.returncode, proc.stdout
    except subprocess.TimeoutExpired as e:
        code, output = -9, f"{(e.output or b'')[-3000:]!r}\n... killed after {HANG_GUARD_S[command.kind]} s"
    return Result(command, code, time.perf_counter() - start, _children_cpu() - cpu_start, output[-3000:])


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_source(source: Source, kinds: tuple[str, ...] = ("short",), log=print) -> list[Result]:
    """Run the source's commands of the given kinds, in the order printed, in one fresh copy of
    the repository (removed afterwards); the others are listed, not run."""
    results, cwd = [], fresh_copy()
    try:
        for command in source.commands:
            if command.kind not in kinds:
                results.append(Result(command, None))
                log(f"  not run ({command.kind}{': ' + command.reason if command.reason else ''}): {command.text}")
                continue
            result = run_command(command, cwd)
            results.append(result)
            verdict = "ok" if result.returncode == command.exit else f"FAILED (exit {result.returncode})"
            log(f"  {result.seconds:6.1f} s (cpu {result.cpu_seconds:6.1f} s) {verdict}: {command.text}")
    finally:
        shutil.rmtree(cwd, ignore_errors=True)
    return results


def failures(results: list[Result]) -> list[str]:
    """A message for each command that ran and did not end with the status its text gives it."""
    return [f"{r.command.where}: `{r.command.text}` exited {r.returncode}, expected {r.command.exit}:\n{r.output}"
            for r in results if r.returncode is not None and r.returncode != r.command.exit]


def main() -> None:
    parser = argparse.ArgumentParser(description="the book's printed commands: list them, or run them")
    parser.add_argument("action", choices=["list", "run"])
    parser.add_argument("--all", action="store_true", help="run the long commands too")
    parser.add_argument("--source", action="append", help="only this text (e.g. chapters/08_capstone/README.md)")
    args = parser.parse_args()
    sources = [s for s in book_sources() if not args.source or s.name in args.source]
    problems = [p for s in sources for p in s.problems]
    for p in problems:
        print("PROBLEM", p)
    if args.action == "list":
        for s in sources:
            for c in s.commands:
                print(f"{c.kind:8} exit {c.exit}  {c.where}: {c.text}" + (f"   [{c.reason}]" if c.reason else ""))
        counts = {k: sum(c.kind == k for s in sources for c in s.commands) for k in ("short", "long", "not-run")}
        print(f"{sum(counts.values())} commands: " + ", ".join(f"{n} {k}" for k, n in counts.items()))
        sys.exit(1 if problems else 0)
    failed = list(problems)
    for s in sources:
        if s.commands:
            print(s.name, flush=True)
            failed += failures(run_source(s, ("short", "long") if args.all else ("short",),
                                          log=lambda m: print(m, flush=True)))
    print("\n".join(failed) if failed else "every command ran as printed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
