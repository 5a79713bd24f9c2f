"""Chapter 03: pipeline parallelism, Megatron-LM style (megatron/core/pipeline_parallel/).

Read in this order:

  schedules.py  which forwards and backwards a stage runs, in which order: GPipe, 1F1B and
                interleaved 1F1B as pure functions of (pp_size, pp_rank, micro-batches, chunks)
  timeline.py   the bubble: every schedule simulated with unit costs, the textbook formula,
                the in-flight micro-batches, and the pipeline diagram
  stages.py     which layers each rank (and each of its chunks) holds, the stage itself, and
                the tied embedding's two copies (their gradients summed after each step)
  p2p.py        activations forward and gradients backward between stages, through the ledger
  executor.py   one training step of a schedule on real ranks: forwards, backwards, p2p, the
                data-parallel sync after the last backward

parallelize.build_model cuts the one model into this rank's chunks (build_stage), and
train.train_step runs forward_backward_pipelining when pp > 1.
"""

from .executor import evaluate_pipelining, forward_backward_pipelining
from .p2p import PipelineComm
from .schedules import KINDS, check_schedule_args, interleaved_order, num_warmup_microbatches, schedule
from .stages import build_stage, stage_layers, virtual_stage
from .timeline import Interval, bubble_fraction, idle_fraction, peak_in_flight, simulate

__all__ = ["KINDS", "schedule", "check_schedule_args", "interleaved_order", "num_warmup_microbatches", "stage_layers",
           "virtual_stage", "build_stage", "PipelineComm", "forward_backward_pipelining", "evaluate_pipelining",
           "Interval", "simulate", "bubble_fraction", "idle_fraction", "peak_in_flight"]
