"""The book's measured numbers: every chapter's text agrees with its recorded run
(booktools/measured.py), and the checker itself catches each kind of drift."""

import json
import os
import subprocess
import sys

import pytest

from booktools import measured
from booktools.demo import import_chapter
from booktools.measured import RoundOff, changed_values, check_text, format_like, rewrite_text, same_printout

RECORD = {"values": {"loss": 2.8371, "bytes": 1400864, "diff": 1.38e-17, "pct": 13.6, "dparam": 1.136e-15},
          "round_off": ["dparam"],
          "runs": {"tp2": {"command": "torchrun --standalone --nproc_per_node=4 demo.py --tp 2",
                           "output": ["[1/2] equivalence", "      loss max |diff| = 8.882e-16", "[2/2] bytes",
                                      "      one device: 1,400,864 bytes", "MATCH: max |dloss| 8.9e-16"]}}}


@pytest.mark.parametrize("token, value, written", [
    ("2.84", 2.8371, "2.84"), ("1.4e-17", 1.38e-17, "1.4e-17"), ("41{,}344", 41344, "41{,}344"),
    ("1,400,872", 1400864, "1,400,864"), ("14", 13.6, "14"), ("−2", -2.06, "−2"), ("3e-3", 0.0031, "3e-3"),
    ("0.50", 0.5049, "0.50")])
def test_a_value_is_written_in_the_style_the_text_chose(token, value, written):
    assert format_like(token, value) == written


def test_the_checker_accepts_a_text_that_quotes_the_record():
    text = ("The loss starts at 2.84<!--m:loss--> and one device holds 1,400,864<!--m:bytes--> bytes;\n"
            "SP saves 14<!--m:pct-->% (max |Δ| 1.4e-17<!--m:diff-->).\n\n<!--run:tp2-->\n```\n[1/2] equivalence\n"
            "...\n      one device: 1,400,864 bytes\n```\n")
    assert check_text("t.md", text, RECORD) == []


@pytest.mark.parametrize("text, complaint", [
    ("the loss is 2.85<!--m:loss-->", "the text says 2.85, the record loss = 2.8371"),
    ("bytes: 1,400,872<!--m:bytes-->", "the text says 1,400,872"),
    ("a number <!--m:nothing--> here 7", "names no recorded value"),
    ("no number before <!--m:loss-->", "has no number before it"),
    ("<!--run:tp2-->\n```\n      one device: 1,400,872 bytes\n```", "run tp2 printed 'one device: 1,400,864 bytes', the text says"),
    ("<!--run:tp2-->\n```\n[3/3] not printed at all\n```", "not in run tp2's printout"),
    ("<!--run:tp2-->\n```\n[2/2] bytes\n[1/2] equivalence\n```", "not in run tp2's printout"),   # order
    ("<!--run:tp4-->\n```\nMATCH\n```", "no recorded run 'tp4'"),
    ("parameters within 1.1e-15<!--m:dparam-->", "dparam = 1.136e-15 is round-off, its digits differ by machine"),
    ("parameters below 1e-15<!--m<:dparam-->", "the text says below 1e-15, the record dparam = 1.136e-15"),
    ("parameters about 1e-17<!--m~:dparam-->", "the text says about 1e-17, the record dparam = 1.136e-15"),
    ("parameters about 2e-14<!--m~:dparam-->", "the text says about 2e-14"),
    ("a printout without a marker:\n```\n[1/2] equivalence\nMATCH: yes\n```", "looks like a printout"),
])
def test_the_checker_names_each_kind_of_drift(text, complaint):
    problems = check_text("t.md", text, RECORD)
    assert len(problems) == 1 and complaint in problems[0], problems


def test_a_round_off_value_is_quoted_as_a_bound_or_a_magnitude():
    text = "below 1e-12<!--m<:dparam--> (the tolerance 1e-9), about 1e-15<!--m~:dparam-->, about 9e-15<!--m~:dparam-->"
    assert check_text("t.md", text, RECORD) == []
    assert rewrite_text(text, RECORD) == (text, [])               # a bound is the text's claim: rewrite keeps it


def test_a_timing_is_marked_as_the_benchmarks_report_s():
    benchmarks = "| 2 threads | 5,120 tokens/s | 1.07x |"
    assert check_text("t.md", "about 5,120<!--bench--> tokens/s, 1.07<!--bench-->x", RECORD, benchmarks) == []
    problems = check_text("t.md", "about 5,121<!--bench--> tokens/s", RECORD, benchmarks)
    assert len(problems) == 1 and "5,121 (<!--bench-->) is not in benchmarks/README.md" in problems[0]


def test_rewrite_puts_the_record_back_in_the_text_s_style():
    stale = ("loss 2.90<!--m:loss-->, 1,400,872<!--m:bytes--> bytes, 41{,}344 untouched, 2e-17<!--m:diff-->\n"
             "<!--run:tp2-->\n```\n      one device: 1,400,872 bytes\n```")
    text, unplaced = rewrite_text(stale, RECORD)
    assert text.splitlines()[0] == "loss 2.84<!--m:loss-->, 1,400,864<!--m:bytes--> bytes, 41{,}344 untouched, 1e-17<!--m:diff-->"
    assert "      one device: 1,400,864 bytes" in text and unplaced == []
    assert check_text("t.md", text, RECORD) == []


def test_a_fresh_run_is_compared_by_its_words_and_numbers_not_its_timings():
    recorded = ["trained in 3.5 s", "loss 2.4747", "max |diff| = 8.9e-16", "1,400,864 bytes"]
    assert same_printout(recorded, ["trained in 9.1 s", "loss 2.4748", "max |diff| = 3.1e-16", "1,400,864 bytes"]) == []
    assert same_printout(recorded, ["trained in 3.5 s", "loss 2.5747", "max |diff| = 8.9e-16", "1,400,864 bytes"])
    assert same_printout(recorded, ["trained in 3.5 s", "loss 2.4747", "max |diff| = 8.9e-16", "1,400,872 bytes"])
    assert same_printout(recorded, ["trained in 3.5 s", "loss is 2.4747", "max |diff| = 8.9e-16", "1,400,864 bytes"])


# The printout of a float64 run on the machine that recorded it, and lines of the same run as
# another machine prints them (tests/test_measured.py reruns recorded commands on any machine).
ROUND_OFF_RUN = ["[1/4] equivalence with the single-device run:",
                 "        loss       max |diff| = 8.882e-16   (tolerance 1e-10)",
                 "        parameters max |diff| = 1.136e-15   (rtol 1e-09, atol 1e-11) embedding.word_embeddings.weight",
                 "MATCH: max |dloss| 8.9e-16 (tol 1e-10), max |dparam| 1.1e-15 (rtol 1e-09, atol 1e-11)",
                 "stage 0: 16 sends+receives, 524,288 bytes"]


def another_machine(line: int, text: str) -> list[str]:
    return ROUND_OFF_RUN[:line] + [text] + ROUND_OFF_RUN[line + 1:]


@pytest.mark.parametrize("line, text", [
    (1, "        loss       max |diff| = 0.000e+00   (tolerance 1e-10)"),            # rounded alike here
    (1, "        loss       max |diff| = 1.776e-15   (tolerance 1e-10)"),
    (2, "        parameters max |diff| = 2.272e-15   (rtol 1e-09, atol 1e-11) decoder.layers.2.mlp.linear_fc1.weight"),
    (2, "        parameters max |diff| = 1.277e-14   (rtol 1e-09, atol 1e-11) decoder.layers.0.mlp.linear_fc1.weight"),
    (2, "        parameters max |diff| = 2.3e-16   (rtol 1e-09, atol 1e-11) output_layer.weight"),
    (3, "MATCH: max |dloss| 0.0e+00 (tol 1e-10), max |dparam| 3.4e-15 (rtol 1e-09, atol 1e-11)"),
])
def test_a_round_off_figure_may_differ_by_machine(line, text):
    assert same_printout(ROUND_OFF_RUN, another_machine(line, text)) == []


@pytest.mark.parametrize("line, text, complaint", [
    (1, "        loss       max |diff| = 2.000e-10   (tolerance 1e-10)", "above its tolerance 1e-10"),
    (1, "        loss       max |diff| = 8.882e-16   (tolerance 1e-09)", "1e-10 recorded, 1e-09 printed now"),
    (2, "        parameters max |diff| = 1.136e-15   (rtol 1e-09, atol 1e-10) output_layer.weight", "1e-11 recorded"),
    (2, "        parameters max |diff| = 1.136e-15   (rtol 1e-09, atol 1e-11)", "recorded"),        # the name is gone
    (2, "        parameters max |diff| = 2.4e-13   (rtol 1e-09, atol 1e-11) output_layer.weight", "more than 100x apart"),
    (3, "MATCH: max |dloss| 8.9e-16 (tol 1e-10), max |dparam| 1.1e-09 (rtol 1e-09, atol 1e-11)", "above its tolerance"),
    (3, "MISMATCH: max |dloss| 8.9e-16 (tol 1e-10), max |dparam| 1.1e-15 (rtol 1e-09, atol 1e-11)", "recorded"),
    (4, "stage 0: 16 sends+receives, 524,289 bytes", "524,288 recorded, 524,289 printed now"),
])
def test_a_round_off_figure_is_held_to_its_tolerance_and_magnitude(line, text, complaint):
    problems = same_printout(ROUND_OFF_RUN, another_machine(line, text))
    assert len(problems) == 1 and all(word in problems[0] for word in complaint.split(", ")), problems


def test_a_quoted_round_off_line_is_rewritten_with_the_tensor_another_run_names():
    record = {"runs": {"pp": {"command": "python demo.py", "output": [ROUND_OFF_RUN[2].replace(
        "1.136e-15", "2.272e-15").replace("embedding.word_embeddings", "decoder.layers.2.mlp.linear_fc1")]}}}
    text = f"<!--run:pp-->\n```\n{ROUND_OFF_RUN[2]}\n```"
    problems = check_text("t.md", text, record)
    assert len(problems) == 1 and "run pp printed" in problems[0], problems      # a quote is the record's line
    fixed, unplaced = rewrite_text(text, record)
    assert unplaced == [] and "2.272e-15" in fixed and "linear_fc1" in fixed and check_text("t.md", fixed, record) == []


def test_a_recomputed_round_off_value_is_compared_by_magnitude_and_the_rest_by_digits():
    recorded = {"eps_grad_diff": 2.0975754466689978e-10, "params": 344928, "lr": 0.003}
    assert changed_values(recorded, {"eps_grad_diff": RoundOff(5.2e-10), "params": 344928, "lr": 0.003}) == {}
    assert changed_values(recorded, {"eps_grad_diff": RoundOff(3e-8), "params": 344928, "lr": 0.003})
    assert changed_values(recorded, {"eps_grad_diff": 5.2e-10, "params": 344928, "lr": 0.003})       # not RoundOff
    assert changed_values(recorded, {"eps_grad_diff": RoundOff(2.1e-10), "params": 344929, "lr": 0.003})
    assert changed_values(recorded, {"eps_grad_diff": RoundOff(2.1e-10), "params": 344928})
    assert changed_values(recorded, {**recorded, "new": 1})


@pytest.mark.parametrize("chapter", measured.chapters())
def test_every_quoted_number_of_the_chapter_is_its_recorded_one(chapter):
    """README (figure captions included) and notebook markdown against chapters/NN_*/measured.json.
    To fix a failure: `make numbers CH=NN` re-measures the chapter and rewrites the numbers."""
    problems = measured.check_chapter(chapter)
    assert not problems, f"{len(problems)} problem(s):\n" + "\n".join(problems[:40])


@pytest.mark.parametrize("chapter", measured.chapters())
def test_the_recorded_values_are_what_measure_computes_now(chapter):
    """The values come from the recorded printouts and the package's own functions: computed
    again from the record, by today's code, they are the recorded ones (a change to the code
    that moves a quoted number fails here, not silently in the text)."""
    spec = import_chapter(chapter, "make_figures")
    record = measured.load_record(chapter)
    assert set(record["runs"]) == set(spec.RUNS), "the record's runs are not the chapter's RUNS: make numbers CH=" + chapter
    assert all(record["runs"][r]["command"] == spec.RUNS[r] for r in spec.RUNS), "a RUNS command changed: make numbers"
    now = measured.measure_chapter(spec, record["runs"])
    changed = measured.changed_values(record["values"], now)
    assert not changed, f"recorded vs computed now (make numbers CH={chapter}): {changed}"
    assert record.get("round_off", []) == sorted(k for k, v in now.items() if isinstance(v, measured.RoundOff)), \
        f"the record's round-off keys are not measure()'s: make numbers CH={chapter}"


def test_capture_prints_what_main_prints_and_keeps_the_dataclass_it_returns(tmp_path):
    script = tmp_path / "tool.py"
    script.write_text("import dataclasses, sys\n"
                      "@dataclasses.dataclass\n"
                      "class Out:\n"
                      "    exit_code: int\n"
                      "    twice: list\n"
                      "def main(argv=None):\n"
                      "    n = int(argv[0])\n"
                      "    print(f'twice {n} is {2 * n}')\n"
                      "    return Out(3, [n, 2 * n])\n"
                      "if __name__ == '__main__':\n"
                      "    sys.exit(main(sys.argv[1:]).exit_code)\n")
    kept = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, "-m", "booktools.capture", str(script), "21"], cwd=measured.ROOT,
                          capture_output=True, text=True, env={**os.environ, "BOOK_RESULTS": str(kept)}, timeout=60)
    assert (proc.returncode, proc.stdout) == (3, "twice 21 is 42\n"), proc.stderr
    assert json.loads(kept.read_text()) == {"exit_code": 3, "twice": [21, 42]}


# Words a chapter's measure() still reads from a printout, by chapter and run: a claim about
# what a run printed (the planner's refusal), not a number.
READS_ITS_PRINTOUT = {"08": ("plan-deepseek-published",)}


@pytest.mark.parametrize("chapter", measured.chapters())
def test_the_values_come_from_the_results_the_runs_returned_not_from_their_printouts(chapter):
    """Issue 33: each recorded run's main returns its results (booktools/capture.py), and measure()
    reads its numbers there. Given blank printouts, it computes the recorded values all the same."""
    spec = import_chapter(chapter, "make_figures")
    record = measured.load_record(chapter)
    kept = READS_ITS_PRINTOUT.get(chapter, ())
    runs = {run_id: run if run_id in kept else {**run, "output": []} for run_id, run in record["runs"].items()}
    now = measured.measure_chapter(spec, runs)
    assert not measured.changed_values(record["values"], now), "measure() reads a number from a printout"


# One cheap recorded run per chapter, run again: its printout must still be the recorded one
# (words equal, integers equal, round-off figures below their tolerance and of the recorded
# magnitude, other numbers within 1e-3 or both below 1e-4; times ignored).
# A chapter whose printout has timing rows names them in its make_figures.py (MACHINE_DEPENDENT).
RERUN = {"00": "figures", "01": "figures", "02": "demo", "03": "demo-1f1b", "04": "tp2-sp", "05": "ep4", "06": "fp16",
         "07": "block-pp", "08": ("plan-mixtral", "plan-measured")}


@pytest.mark.parametrize("chapter, run_id", [(chapter, run) for chapter, runs in sorted(RERUN.items())
                                             for run in ((runs,) if isinstance(runs, str) else runs)])
def test_a_recorded_run_prints_the_same_today(chapter, run_id):
    record = measured.load_record(chapter)["runs"][run_id]
    figures = measured.chapter_dir(chapter) / "figures"
    kept = {path: path.read_bytes() for path in figures.glob("*")}     # a run may redraw them: put them back
    try:
        fresh = measured.run_command(record["command"], timeout=600)
    finally:
        for path, data in kept.items():
            path.write_bytes(data)
    assert fresh["exit"] == record["exit"], fresh["stderr_tail"]
    machine = getattr(import_chapter(chapter, "make_figures"), "MACHINE_DEPENDENT", None)
    problems = same_printout(record["output"], fresh["output"], machine=machine)
    assert not problems, (f"{chapter} {run_id} ({record['command']}) no longer prints what the text quotes; "
                          f"make numbers CH={chapter}:\n" + "\n".join(problems))
