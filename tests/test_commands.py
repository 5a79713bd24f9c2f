"""Every command the book prints runs as printed (issue 32; booktools/commands.py has the rule).

The commands of README.md, chapters/*/README.md and the notebooks' markdown run in the order
printed, one fresh copy of the repository per text, and each must exit with the status its
text gives it (0 unless marked <!--cmd exit N (why)-->). Here only the unmarked ones run: those
under 30 s on 2 cores (30 of the 50). `make check-commands` (BOOK_COMMANDS=all) runs the
<!--cmd long--> ones too (10). <!--cmd not-run (why)--> commands (10) are listed with their
reason, never run. 3 min 54 s on 2 shared cores (2026-12-07), nearly all in the commands."""

import os

import pytest

from booktools import commands
from booktools.commands import book_sources, failures, parse_text, run_source

KINDS = ("short", "long") if os.environ.get("BOOK_COMMANDS") == "all" else ("short",)


# --- the extraction rule, on texts made for it ------------------------------------------------

def test_a_bash_block_gives_every_line_but_comments_and_joins_continuations():
    text = ("```bash\n# a comment\npython a.py --x 1   # what it does\n\nmake b\ntorchrun --nproc_per_node 2 c.py \\\n"
            "    --y 2\n```\n")
    source = parse_text("t.md", text)
    assert [c.text for c in source.commands] == ["python a.py --x 1   # what it does", "make b",
                                                 "torchrun --nproc_per_node 2 c.py --y 2"]
    assert [c.where for c in source.commands] == ["t.md line 3", "t.md line 5", "t.md line 6"]
    assert source.problems == []


def test_a_prompted_line_is_a_command_and_what_follows_is_its_printout():
    source = parse_text("t.md", "```\n$ python demo.py --quick\n[1/2] equivalence\nMATCH\n```\n")
    assert [c.text for c in source.commands] == ["python demo.py --quick"]


def test_code_and_printouts_are_not_commands():
    text = "```python\nimport torch\n```\n```\nF0 F1 B0 B1\n```\nrun `python x.py` inline\n"
    assert parse_text("t.md", text).commands == []


def test_an_untagged_block_of_commands_is_a_problem_of_the_text():
    source = parse_text("t.md", "text\n```\npython chapters/00_single_device/demo.py\n```\n")
    assert source.commands == [] and "not tagged ```bash" in source.problems[0]


def test_markers_pick_commands_by_their_words_and_give_kinds_reasons_and_statuses():
    text = ("<!--cmd long: make demo-->\n<!--cmd not-run (needs an NVIDIA GPU): gpu-check-->\n"
            "<!--cmd exit 1 (the stubs are unfilled): --impl=learner-->\n<!--run:demo-->\n```bash\n"
            "make demo\nmake gpu-check\npython -m pytest tests/graders --impl=learner\npython a.py\n```\n")
    source = parse_text("t.md", text)
    assert source.problems == []
    assert [(c.kind, c.reason, c.exit) for c in source.commands] == [
        ("long", "", 0), ("not-run", "needs an NVIDIA GPU", 0), ("short", "the stubs are unfilled", 1),
        ("short", "", 0)]
    every = parse_text("t.md", "<!--cmd not-run (a cluster)-->\n```bash\nsrun a\nsrun b\n```\n")
    assert [c.kind for c in every.commands] == ["not-run", "not-run"]


@pytest.mark.parametrize("marker, complaint", [
    ("<!--cmd not-run: make a-->", "needs a reason"),
    ("<!--cmd long: make z-->", "'make z' picks no command"),
    ("<!--cmd slow: make a-->", "does not parse"),
])
def test_a_marker_that_says_nothing_true_is_a_problem(marker, complaint):
    source = parse_text("t.md", f"{marker}\n```bash\nmake a\n```\n")
    assert any(complaint in p for p in source.problems), source.problems


def test_an_unmarked_command_that_fails_fails_the_test(tmp_path, monkeypatch):
    monkeypatch.setattr(commands, "fresh_copy", lambda: tmp_path)
    source = parse_text("t.md", "<!--cmd exit 3 (it says so)-->\n```bash\npython -c 'raise SystemExit(3)'\n```\n"
                                "```bash\npython -c 'open(\"here\", \"w\")'\npython -c 'open(\"here\")'\n"
                                "python -c 'raise SystemExit(3)'\n```\n")
    results = run_source(source, log=lambda m: None)
    assert [r.returncode for r in results] == [3, 0, 0, 3]     # the second and third: same folder, in order
    problems = failures(results)
    assert len(problems) == 1 and "t.md line 8" in problems[0] and "exited 3, expected 0" in problems[0]


# --- the book ---------------------------------------------------------------------------------

SOURCES = [s for s in book_sources() if s.commands]


def test_every_command_of_the_book_is_found_and_its_markers_are_well_formed():
    problems = [p for s in book_sources() for p in s.problems]
    assert not problems, "\n".join(problems)
    assert {s.name for s in SOURCES} >= {"README.md", "chapters/08_capstone/README.md"}


@pytest.mark.parametrize("source", SOURCES, ids=[s.name for s in SOURCES])
def test_every_printed_command_runs_as_printed(source):
    results = run_source(source, KINDS)
    problems = failures(results)
    assert not problems, "\n\n".join(problems)


def test_a_resume_with_nothing_left_to_train_says_so(tmp_path, capsys):
    """What chapter 08 §1 printed before its fix: a resume at 2 of 2 trained nothing, silently."""
    from minimegatron.train import main
    common = ["--preset", "tiny", "--train-iters", "2", "--eval-interval", "0", "--no-progress",
              "--ckpt-format", "torch_dist", "--out-dir", str(tmp_path / "out")]
    assert main([*common, "--save", str(tmp_path / "a")]) == 0
    capsys.readouterr()
    assert main([*common, "--load", str(tmp_path / "a"), "--save", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "resumed at iteration 2, and --train-iters is 2: nothing left to train" in out
    assert f"nothing saved to {tmp_path / 'b'}" in out
