"""The capstone walk-through: the book's whole path for one model, as a team would run it.

    make capstone                                  # or: python chapters/08_capstone/capstone.py (about 2 minutes)
    python chapters/08_capstone/capstone.py --quick     # 4 ranks, a few steps (what the tests run)

Each step is a command a learner could type; the script prints it, runs it, and checks what
came out:

  [1/5] train the 5D GPT-MoE of `make demo` (tp 2 + SP x cp 2 x pp 2 x ep 2 x dp 2 on 16 ranks,
        8 experts, top-2) under torchrun, saving a torch_dist checkpoint and stopping there
        (--exit-interval);
  [2/5] resume it under another layout (tp 2 + SP x pp 2 on 4 ranks, the experts unsplit) to
        the end, with the same global batch: the loss curve continues;
  [3/5] export it to Hugging Face (a MixtralForCausalLM folder) and import it back: the same
        weights, bit for bit;
  [4/5] generate from the book's checkpoint with a KV cache (greedy, one process: a mixture under
        tensor parallelism needs sequence parallelism, which decoding cannot use), and from
        transformers' generate on the exported folder when transformers is installed (the same
        greedy text);
  [5/5] plan the same model on a cluster of 1,024 H100s (python -m minimegatron.plan's search).

It ends with a line starting DONE (exit 0), or stops at the first step that fails (exit 1).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MOE = ["--preset", "demo", "--num-layers", "4", "--num-experts", "8", "--moe-router-topk", "2",
       "--moe-aux-loss-coeff", "1e-2", "--ckpt-format", "torch_dist", "--eval-interval", "0", "--no-progress"]
FULL = dict(ranks=16, iters=60, stop=30, first=["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                                  "--context-parallel-size", "2", "--pipeline-model-parallel-size",
                                                  "2", "--expert-model-parallel-size", "2", "--micro-batch-size",
                                                  "1", "--grad-accum-steps", "4"],
            second_ranks=4, second=["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                    "--pipeline-model-parallel-size", "2", "--micro-batch-size", "1",
                                    "--grad-accum-steps", "8"])
QUICK = dict(ranks=4, iters=6, stop=3, first=["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                              "--expert-model-parallel-size", "2", "--micro-batch-size", "2",
                                              "--grad-accum-steps", "2"],
             second_ranks=2, second=["--pipeline-model-parallel-size", "2", "--micro-batch-size", "2",
                                     "--grad-accum-steps", "4"])
PROMPT = "Pipeline parallelism"


def run(title: str, command: list[str]) -> str:
    """Print `command` as a learner would type it, run it from the repository's root, return its
    output; SystemExit(1) with the output's tail when it fails."""
    shown = " ".join(shlex.quote(c) for c in command).replace(sys.executable, "python")
    print(f"{title}\n  $ {shown}", flush=True)
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        print((proc.stdout + proc.stderr)[-3000:])
        raise SystemExit(1)
    return proc.stdout


def torchrun(ranks: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *args]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 ranks and a few steps")
    parser.add_argument("--dir", default=None, help="where to write (default: a new temporary folder)")
    args = parser.parse_args(argv)
    if args.dir and Path(args.dir).is_dir() and any(Path(args.dir).iterdir()):
        parser.error(f"--dir {args.dir} is not empty: the walk-through trains, exports and imports into a fresh "
                     f"folder (a second run there would resume the first's checkpoint and refuse to overwrite its "
                     f"export); give a new or empty folder")
    p = QUICK if args.quick else FULL
    work = Path(args.dir or tempfile.mkdtemp(prefix="minimegatron-capstone-"))
    ckpt, hf, back = work / "ckpt", work / "hf", work / "back"
    common = MOE + ["--train-iters", str(p["iters"]), "--out-dir", str(work / "runs"), "--save", str(ckpt)]

    run(f"[1/5] train the GPT-MoE on {p['ranks']} ranks, stop after iteration {p['stop']} (saved)",
        torchrun(p["ranks"], "-m", "minimegatron.train", *common, *p["first"], "--exit-interval", str(p["stop"])))
    first = json.loads((work / "runs" / "losses.json").read_text())["train"]
    print(f"  iterations 1-{len(first)}: loss {first[0]:.3f} -> {first[-1]:.3f}")

    out = run(f"[2/5] resume under another layout on {p['second_ranks']} ranks, to iteration {p['iters']}",
              torchrun(p["second_ranks"], "-m", "minimegatron.train", *common, *p["second"], "--load", str(ckpt)))
    losses = json.loads((work / "runs" / "losses.json").read_text())["train"]
    resumed = next(line for line in out.splitlines() if line.startswith("resumed from"))
    print(f"  {resumed.split(': ', 1)[1]}")
    if losses[:len(first)] != first or len(losses) != p["iters"]:
        print("  the resumed history is not the first run's")
        return 1
    print(f"  iterations {len(first) + 1}-{len(losses)}: loss {losses[len(first)]:.3f} -> {losses[-1]:.3f}")

    run("[3/5] export to Hugging Face, and import it back",
        [sys.executable, "-m", "minimegatron.convert", "--load", str(ckpt), "--to-hf", str(hf)])
    run("", [sys.executable, "-m", "minimegatron.convert", "--from-hf", str(hf), "--save", str(back)])
    from minimegatron.dist_checkpoint import load_full_state
    import torch
    before, after = load_full_state(ckpt / f"iter_{p['iters']:07d}"), load_full_state(back / "iter_0000000")
    same = set(before) == set(after) and all(torch.equal(t, after[n]) for n, t in before.items())
    print(f"  {json.loads((hf / 'config.json').read_text())['architectures'][0]}, {len(before)} tensors; "
          f"back again {'bit-identical' if same else 'NOT identical'}")
    if not same:
        return 1

    gen = ["-m", "minimegatron.generate", "--load", str(ckpt), "--prompt", PROMPT, "--max-new-tokens", "24"]
    one = run("[4/5] generate with a KV cache, greedy, on one process", [sys.executable, *gen]).splitlines()[0]
    print(f"  book:         {one!r}\n  (not under tp 2: a mixture under tensor parallelism routes s/tp tokens per "
          f"rank, sequence parallelism, which a one-token step cannot use; tests/test_generate.py shows tp 2 on "
          f"a dense model)")
    try:
        import transformers
    except ImportError:
        print("  transformers is not installed (pip install -r requirements-bench.txt): its generate skipped")
    else:
        from minimegatron.data import build_tokenizer
        tokenizer = build_tokenizer("byte")
        model = transformers.AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
        ids = torch.tensor([tokenizer.encode(PROMPT)])
        out_ids = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
        text = PROMPT + tokenizer.decode(out_ids[0, ids.shape[1]:].tolist())
        print(f"  transformers: {text!r} ({'the same' if text == one else 'DIFFERENT'})")
        if text != one:
            return 1

    print("[5/5] plan the same model on 1,024 H100s (minimegatron.plan.search)")
    from minimegatron.arguments import parse_command_line
    from minimegatron.plan import CLUSTERS, format_plan, search
    model_cfg, _, _ = parse_command_line(MOE + ["--train-iters", "1", "--bf16"], world_size=1)   # planned in bf16
    plan = search(model_cfg, CLUSTERS["h100-sxm"], gpus=1024, seq_length=64, global_batch_size=8192, keep=3,
                  progress=False)
    table = format_plan(plan, "the capstone's GPT-MoE", model_cfg, CLUSTERS["h100-sxm"], top=3).splitlines()
    start = next((i for i, line in enumerate(table) if line.startswith(("top", "NO layout"))), 0)
    print("\n".join("  " + line for line in table[start:start + 6]))
    if not plan.plans:
        return 1
    from minimegatron.analysis import count_parameters
    print(f"  ({count_parameters(model_cfg)['total']:,} parameters: no layout keeps 1,024 GPUs busy with a model this "
          f"small; run the planner on a real one, e.g. python -m minimegatron.plan --model mixtral-8x7b --gpus 1024 "
          f"--global-batch-size 1024)")
    print(f"DONE: trained, resharded, exported, generated and planned; files in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
