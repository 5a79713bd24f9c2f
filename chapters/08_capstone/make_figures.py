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
  plan-measured  chapters/08_capstone/plan_vs_measured.py: the planner's bytes and memory against
                 seven layouts trained on 4 ranks here
  plan-gpt3, plan-deepseek (and -published: the published layout pinned)   the planner against
                 GPT-3 175B's layout of Narayanan et al. 2021 and DeepSeek-V3's
"""

from __future__ import annotations

import re
import sys

from booktools.measured import RoundOff, claim, grab

PLAN = "python -m minimegatron.plan --cluster h100-sxm --top 3"
GPT3 = ("python -m minimegatron.plan --cluster a100-80gb --model gpt3-175b --gpus 1536 --seq-length 2048 "
        "--global-batch-size 1536")
DEEPSEEK = ("python -m minimegatron.plan --cluster h100-sxm --model deepseek-v3 --gpus 2048 --seq-length 4096 "
            "--global-batch-size 15360")
RUNS = {
    "reshard": "python chapters/08_capstone/demo.py",
    "plan-llama70b": f"{PLAN} --model llama3-70b --gpus 1024 --seq-length 8192 --global-batch-size 1024",
    "plan-mixtral": f"{PLAN} --model mixtral-8x7b --gpus 64 --seq-length 4096 --global-batch-size 512",
    "generate": "python benchmarks/bench_generate.py",                          # timed
    "plan-measured": "python chapters/08_capstone/plan_vs_measured.py",
    # published layouts: GPT-3 175B on 1,536 A100s (Narayanan et al. 2021, Table 2: tp 8, pp 12,
    # dp 16, micro-batch 1, batch 1,536); DeepSeek-V3 on 2,048 GPUs (its report, section 3.2: pp 16,
    # ep 64, ZeRO-1 dp, no tp; sequences of 4K, batch 15,360)
    "plan-gpt3": f"{GPT3} --top 3",
    "plan-gpt3-published": f"{GPT3} --top 1 --tensor-model-parallel-size 8 --pipeline-model-parallel-size 12 "
                           "--context-parallel-size 1",
    "plan-deepseek": f"{DEEPSEEK} --top 3",
    "plan-deepseek-published": f"{DEEPSEEK} --top 1 --tensor-model-parallel-size 1 --pipeline-model-parallel-size 16 "
                               "--expert-model-parallel-size 64",
}
MACHINE_DEPENDENT = ()
EXPECTED_EXIT = {"plan-deepseek-published": 1}     # the planner exits 1 when no layout fits


def measure(outputs: dict[str, list[str]], results: dict[str, dict | None]) -> dict[str, float]:
    v = {}
    reshard = outputs["reshard"]
    claim(reshard[-1].startswith("MATCH"), "the reshard grid matches")
    pairs = [line for line in reshard if "-> " in line and "loss max |diff|" in line]
    v["reshard_pairs"] = float(len(pairs))
    v["reshard_loss"] = RoundOff(max(float(x) for x in re.findall(r"loss max \|diff\| ([\d.e+-]+)", "\n".join(pairs))))
    v["reshard_param"] = RoundOff(max(float(x) for x in re.findall(r"parameters max \|diff\| ([\d.e+-]+)", "\n".join(pairs))))
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
    for key in ("gpt3", "gpt3-published", "deepseek"):
        out = outputs[f"plan-{key}"]
        row = r"^  1 +(\d+) +(\d+) +(\d+) (\d+) +(\d+) +(\d+) +(\d+) +(\d+) +(\w+) +(\d+) +(\d+) \| +([\d.]+) .*\| +([\d.]+) +([\d,]+) +([\d.]+)%$"
        name = key.replace("-", "_")
        for i, dim in enumerate(("tp", "cp", "pp", "v", "ep", "etp", "dp", "zero"), start=1):
            v[f"{name}_{dim}"] = grab(out, row, i)
        v[f"{name}_step_s"] = grab(out, row, 13)
        v[f"{name}_mfu"] = grab(out, row, 15)
    claim(grab(outputs["plan-gpt3-published"], r"searched [\d,]+ layouts in [\d.]+ s: ([\d,]+) fit") > 0,
          "the published GPT-3 layout fits")
    published = "\n".join(outputs["plan-deepseek-published"])
    claim("NO layout fits" in published and "num_layers=61 is not divisible by pipeline_model_parallel_size=16"
          in published, "DeepSeek-V3's pp 16 is refused: 61 layers do not split evenly")
    v["deepseek_fit"] = grab(outputs["plan-deepseek"], r"layouts in [\d.]+ s: ([\d,]+) fit")
    pm = outputs["plan-measured"]
    claim(pm[-1].startswith("AGREE"), "the planner agrees with the measured runs")
    claim(not any("DIFFERS" in line or "NOT within" in line for line in pm), "no planned number differs")
    text = "\n".join(pm)
    v["pm_layouts"] = float(len([line for line in pm if line.endswith(":") and not line.startswith(" ")]))
    v["pm_byte_lines"] = float(text.count(": = on all 4 ranks"))
    v["pm_state_worst_pct"] = max(float(x) for x in re.findall(r"state +measured .*: ([\d.]+)% off", text))
    v["pm_act_worst_pct"] = max(float(x) for x in re.findall(r"activations measured .*: ([\d.]+)% off", text))
    v["pm_moe_act_pct"] = grab(pm, r"activations measured .*: ([\d.]+)% off at the mean over the ranks")
    v["pm_etp_pad_pct"] = grab(pm, r"routing-dependent: .*: ([\d.]+)% more")
    return v


def main() -> int:
    print(__doc__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
