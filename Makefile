# The two commands of the quick start: `make demo` and `make test`.
# Both create the virtual environment on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

export OMP_NUM_THREADS ?= 1

.PHONY: demo test venv clean

venv: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

# torchrun on this machine only: rendezvous on 127.0.0.1, a port the OS picks.
TORCHRUN := $(VENV)/bin/torchrun --nnodes=1 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:0 --local-addr=127.0.0.1
DEMO_RANKS ?= 16
DEMO_TP    ?= 2
DEMO_CP    ?= 2
DEMO_PP    ?= 2
DEMO_EP    ?= 2
DEMO_EXPERTS ?= 8
DEMO_PRECISION ?= fp32
DEMO_FP8_RECIPE ?= delayed

# The book's main job: the most parallel run it supports so far (chapter 05: 5D parallelism),
# a GPT-MoE with DEMO_EXPERTS experts (top-2, load-balancing loss) in each of its 4 layers:
# every matrix split over TP=DEMO_TP ranks with sequence parallelism, every sequence split over
# CP=DEMO_CP ranks (ring attention, zig-zag), the experts spread over EP=DEMO_EP ranks (all-to-all
# dispatch; each expert also cut over etp = TP ranks), the layers cut into PP=DEMO_PP pipeline
# stages running 1F1B over 4 micro-batches, and DEMO_RANKS/(DEMO_TP*DEMO_CP*DEMO_PP) data-parallel
# replicas (the experts' gradients summed over their own expert-data-parallel group). The global
# batch stays 8 sequences per step. minimegatron/run_report.py prints the layout and the rank
# grid before training; after it, one step's communication per dimension, the parameters, the
# memory and the bubble against their formulas, and the first 2 steps of the same layout in
# float64 against one process (MATCH), and draws runs/demo/summary.png. 200 steps (the demo
# preset's 300 take over 8 minutes on 2 cores; the wall clock: benchmarks/README.md).
# (`make demo DEMO_EXPERTS=0 DEMO_EP=1`: chapter 04's dense 4D run; `make demo DEMO_RANKS=8 DEMO_CP=1
# DEMO_EXPERTS=0 DEMO_EP=1`: chapter 03's 3D run, about 2). Chapter 06's precisions:
# DEMO_PRECISION=bf16 | fp16 | fp8 (FP8 GEMMs in a bf16 model, DEMO_FP8_RECIPE=tensorwise | delayed |
# blockwise | mxfp8); the check against one process stays in float64 (it checks the layout).
# Chapter 08's walk-through: train the 5D GPT-MoE on 16 ranks, resume it on 4 under another
# layout, export it to Hugging Face and back, generate from it, plan it on 1,024 GPUs (about 2 minutes on 2 cores).
.PHONY: capstone
capstone: $(STAMP)
	$(PY) chapters/08_capstone/capstone.py

demo: $(STAMP)
	OMP_NUM_THREADS=1 $(TORCHRUN) --nproc_per_node=$(DEMO_RANKS) -m minimegatron.run_report --check-steps 2 \
		--preset demo --num-layers 4 --train-iters 200 \
		--tensor-model-parallel-size $(DEMO_TP) $(if $(filter-out 1,$(DEMO_TP)),--sequence-parallel) \
		--context-parallel-size $(DEMO_CP) \
		$(if $(filter-out 0,$(DEMO_EXPERTS)),--num-experts $(DEMO_EXPERTS) --moe-router-topk 2 \
			--moe-aux-loss-coeff 1e-2 --expert-model-parallel-size $(DEMO_EP)) \
		--pipeline-model-parallel-size $(DEMO_PP) --grad-accum-steps 4 \
		--micro-batch-size $$((2 * $(DEMO_TP) * $(DEMO_CP) * $(DEMO_PP) / $(DEMO_RANKS))) \
		$(if $(filter bf16 fp8,$(DEMO_PRECISION)),--bf16) $(if $(filter fp16,$(DEMO_PRECISION)),--fp16) \
		$(if $(filter fp8,$(DEMO_PRECISION)),--fp8-format hybrid --fp8-recipe $(DEMO_FP8_RECIPE)) \
		--out-dir runs/demo

# Every torchrun entry N times (chapters 01-04's demos and minimegatron.train, 4 ranks each),
# two runs at a time; prints per job how many runs exited non-zero after printing MATCH (the
# failure of issue 11) and the total. Logs in runs/stress/. About N x 1 minute on 2 cores.
N ?= 10
.PHONY: stress
stress: $(STAMP)
	$(PY) benchmarks/stress_demos.py --runs $(N) --torchrun "$(TORCHRUN)"

# Every command the book prints (README.md, chapters/*/README.md, the notebooks' markdown), run as
# printed in the order printed, in a fresh copy of the repository per text, the <!--cmd long-->
# ones too (booktools/commands.py has the rule; make test runs tests/test_commands.py without
# the long ones). `python -m booktools.commands list` lists them. 36 minutes on 2 shared cores (2026-12-07;
# make demo 8 of them, make capstone 2 to 4).
.PHONY: check-commands
check-commands: $(STAMP)
	BOOK_COMMANDS=all $(PY) -m pytest -q -s tests/test_commands.py -k runs_as_printed

# The book against other CPUs, simulated on this one (issue 32): tests/test_measured.py (each
# chapter's text against its record, and a fresh rerun) and tests/test_compile.py under each
# variable that sends PyTorch's or MKL's kernels down another code path. OMP_NUM_THREADS=2 reaches
# the test process only: ranks pin themselves to 1 thread (minimegatron/launch.py). About 10 minutes
# on 2 cores (2 a variable). The whole suite under one of them: `ATEN_CPU_CAPABILITY=default make test`.
CPU_VARIANTS ?= ATEN_CPU_CAPABILITY=default ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=COMPATIBLE \
	MKL_ENABLE_INSTRUCTIONS=AVX2 OMP_NUM_THREADS=2
.PHONY: test-other-cpus
test-other-cpus: $(STAMP)
	@for v in $(CPU_VARIANTS); do echo "== $$v"; \
		env $$v $(PY) -m pytest -q tests/test_measured.py tests/test_compile.py || exit 1; done

# Every chapter demo over its documented flags (chapters 06 and 07: each precision x FP8 recipe x
# format and each recompute x kernel path over tp/sp/cp/pp/ep/dp; 01-05 and 08: their main layout
# flags), --quick, one run at a time, and the combinations a demo must refuse (exit 2). Prints
# run -> verdict, exit code, seconds (benchmarks/sweep_demos.py; --list names the runs). About
# 40 minutes on 2 cores; tests/test_demo_sweep.py is its cheap part in make test.
.PHONY: sweep-demos
sweep-demos: $(STAMP)
	$(PY) benchmarks/sweep_demos.py

# Re-measure a chapter's quoted numbers: rerun the commands its text quotes (the RUNS of its
# make_figures.py, figures included), rewrite chapters/NN_*/measured.json, and put the recorded
# numbers back into the README and notebook markdown (booktools/measured.py). CH=all: every chapter.
.PHONY: numbers
numbers: $(STAMP)
	$(PY) -m booktools.measured record $(filter-out all,$(CH))

# On a machine with one NVIDIA GPU only (under 10 minutes on an H100: its budget): the Triton kernels
# compiled for CUDA, flash-attn and Transformer Engine if installed (requirements-gpu.txt), the
# training step on CUDA against the CPU with its tokens/s and MFU, and two gloo ranks sharing the GPU
# against one device (benchmarks/gpu_check.py; --list names the checks). Without CUDA it exits 2.
# Then `make bench-mfu` (below) times the bf16 step at 1B scale.
.PHONY: gpu-check
gpu-check: $(STAMP)
	$(PY) benchmarks/gpu_check.py

# On one NVIDIA GPU, after gpu-check (sized for under 8 minutes on an H100): tokens/s and MFU of the
# book's bf16 training step at LLaMA shapes of 1.1B, 125M and 3B (full recompute), eager, fused Adam,
# compiled, Triton kernels, and a compiled plain-PyTorch reference checked to be the same network
# (benchmarks/bench_mfu.py; --profile PATH shows where the time goes). Without CUDA it exits 2;
# `$(PY) benchmarks/bench_mfu.py --smoke` runs its code on the CPU (tests/test_benchmarks.py does).
.PHONY: bench-mfu
bench-mfu: $(STAMP)
	$(PY) benchmarks/bench_mfu.py

test: $(STAMP)
	$(PY) -m pytest -q tests --ignore=tests/graders
	$(PY) -m booktools.exercises check
	$(GRADE) --impl=reference --check-coverage
	$(GRADE) --impl=stub --check-coverage
	$(PY) -m pytest -q --nbval-lax notebooks

clean:
	rm -rf $(VENV) build runs

# Offline reveal.js decks, one per notebooks/*.ipynb, into build/slides/ (see slides/build.py).
SLIDES_NPM := slides/node_modules/.installed

.PHONY: slides
slides: $(STAMP) $(SLIDES_NPM)
	$(PY) slides/build.py

$(SLIDES_NPM): slides/package.json slides/package-lock.json
	@command -v npm >/dev/null || { echo "make slides: npm not found: install Node.js 18+ (it brings npm)" >&2; exit 1; }
	cd slides && npm ci --no-audit --no-fund
	touch $@

# Exercises: stubs generated from marked regions of the reference code into
# chapters/NN_*/exercises/, graded by tests/graders/ (see booktools/exercises/).
#   make grade CH=00      grade your chapter-00 exercises   (make grade EX=0.1: one exercise)
#   make exercises        write missing/outdated stubs; never overwrites your work
#   make exercises-reset CH=00   back to the unfilled stubs (discards your work)
# CI: exercises-check (committed stubs = generated), grade-reference (every grader passes on
# the book's code), grade-stubs (every grader fails on the unfilled stub, because of it).
GRADE := $(PY) -m pytest -q tests/graders

.PHONY: exercises exercises-check exercises-reset grade grade-reference grade-stubs
exercises: $(STAMP)
	$(PY) -m booktools.exercises generate

exercises-check: $(STAMP)
	$(PY) -m booktools.exercises check

exercises-reset: $(STAMP)
	$(PY) -m booktools.exercises generate --force $(if $(filter-out all,$(CH)),--chapter $(CH))

grade: $(STAMP)
	$(GRADE) --impl=learner $(if $(filter-out all,$(CH)),--chapter $(CH)) $(foreach e,$(EX),--exercise $(e))

grade-reference: $(STAMP)
	$(GRADE) --impl=reference --check-coverage

grade-stubs: $(STAMP)
	$(GRADE) --impl=stub --check-coverage
