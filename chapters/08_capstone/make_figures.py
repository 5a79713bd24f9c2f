"""The numbers chapter 08 quotes (it has no figure yet).

    python chapters/08_capstone/make_figures.py     # prints what `make numbers CH=08` records

RUNS and measure() are what `make numbers CH=08` (python -m booktools.measured record 08)
reruns and records in measured.json; tests/test_measured.py checks the README's quoted numbers
against it:

  reshard        chapters/08_capstone/demo.py: six layout pairs saved and resumed with
                 --ckpt-format torch_dist, against the uninterrupted single-device run, and
                 what each checkpoint holds against the formula
  plan-llama70b  the planner on Llama 3 70B, 1,024 H100s, s 8192, 1,024 sequences a step
  plan-mixtral   the planner on Mixtral 8x7B, 64 H100s, s 4096, 512 sequences a step
  generate       benchmarks/bench_generate.py: tokens/s with and without the KV cache (timed)
"""

from __future__ import annotations

import re
import sys

from booktools.measured import claim, grab

PLAN = "python -m minimegatron.plan --cluster h100-sxm --top 3"
RUNS = {
    "reshard": "python chapters/08_capstone/demo.py",
    "plan-llama70b": f"{PLAN} --model llama3-70b --gpus 1024 --seq-length 8192 --global-batch-size 1024",
    "plan-mixtral": f"{PLAN} --model mixtral-8x7b --gpus 64 --seq-length 4096 --global-batch-size 512",
    "generate": "python benchmarks/bench_generate.py",                          # timed
}
MACHINE_DEPENDENT = ()


def measure(outputs: dict[str, list[str]]) -> dict[str, float]:
    v = {}
    reshard = outputs["reshard"]
    claim(reshard[-1].startswith("MATCH"), "the reshard grid matches")
    pairs = [line for line in reshard if "-> " in line and "loss max |diff|" in line]
    v["reshard_pairs"] = float(len(pairs))
    v["reshard_loss"] = max(float(x) for x in re.findall(r"loss max \|diff\| ([\d.e+-]+)", "\n".join(pairs)))
    v["reshard_param"] = max(float(x) for x in re.findall(r"parameters max \|diff\| ([\d.e+-]+)", "\n".join(pairs)))
    sizes = [line for line in reshard if "tensors " in line and "formula" in line]
    claim(all(" = formula " in line for line in sizes), "every checkpoint holds exactly the formula's bytes")
    v["size_tp2_tensors"] = grab(reshard, r"^  tp=2 dp=2 +tensors ([\d,]+) bytes")
    v["size_tp2_disk"] = grab(reshard, r"^  tp=2 dp=2 +tensors [\d,]+ bytes = formula [\d,]+; on disk ([\d,]+)")
    v["size_dp4_tensors"] = grab(reshard, r"^  dp=4 zero=1 +tensors ([\d,]+) bytes")
    v["size_overhead_max"] = max(float(x) for x in re.findall(r"\(([\d.]+)% more", "\n".join(sizes)))
    for key in ("llama70b", "mixtral"):
        out = outputs[f"plan-{key}"]
        v[f"{key}_flops"] = grab(out, r"num_floating_point_operations: ([\d.e+]+) FLOPs per step")
        v[f"{key}_searched"] = grab(out, r"searched ([\d,]+) layouts")
        v[f"{key}_fit"] = grab(out, r"layouts in [\d.]+ s: ([\d,]+) fit")
        row = r"^  1 +(\d+) +(\d+) +(\d+) (\d+) +(\d+) +(\d+) +(\d+) +(\d+) +(\w+) +(\d+) +(\d+) \| +([\d.]+) .*\| +([\d.]+) +([\d,]+) +([\d.]+)%$"
        for i, name in enumerate(("tp", "cp", "pp", "v", "ep", "etp", "dp", "zero"), start=1):
            v[f"{key}_top_{name}"] = grab(out, row, i)
        v[f"{key}_top_gib"] = grab(out, row, 12)
        v[f"{key}_top_step_s"] = grab(out, row, 13)
        v[f"{key}_top_mfu"] = grab(out, row, 15)
    claim(v["llama70b_top_tp"] <= 8, "the planner keeps tensor parallelism within a node")
    gen = outputs["generate"]
    v["gen_cached_tps"] = grab(gen, r"with the KV cache +([\d.]+) tokens/s")
    v["gen_uncached_tps"] = grab(gen, r"without a cache +([\d.]+) tokens/s")
    v["gen_cached_positions"] = grab(gen, r"with the KV cache .*, ([\d,]+) positions run")
    v["gen_uncached_positions"] = grab(gen, r"without a cache .*, ([\d,]+) positions run")
    v["gen_speedup"] = grab(gen, r"with / without: ([\d.]+) x")
    v["gen_cache_bytes"] = grab(gen, r"the cache: ([\d,]+) bytes = formula")
    claim(v["gen_speedup"] > 1, "the cache makes generation faster")
    return v


def main() -> int:
    print(__doc__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
