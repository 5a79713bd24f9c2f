"""How the parallelisms are applied to the one model, in one order a reader can recite:

    cut into pipeline chunks (03) -> tensor (+ sequence) parallel (02, 04) -> context
    parallel (04) -> expert parallel (05) -> FP8 (06) -> Triton kernels, activation
    recompute (07) -> data-parallel wrapper (01)

`build_model` is that order, in one function; each `apply_*` is a no-op when its size is 1,
so the single device is the same code with every size 1. A new chapter adds one `apply_*`
(which writes the placement records of what it cuts and registers its gradient hooks), one
line in `build_model`, its checks in `validate_layout` (docs/ARCHITECTURE.md, CONTRIBUTING.md).

    validate_layout(model_cfg, train_cfg, world_size)   every impossible layout, named, before
                                                          any process group exists
    chunks = build_model(model_cfg, train_cfg, layout)  this rank's model chunks
    optimizer = build_optimizer(chunks, train_cfg, layout)
    full = full_model_tensors(chunks, layout)           the single-device state dict (collective)

Megatron-LM: megatron/training/training.py (get_model, setup_model_and_optimizer), where
the layer classes are chosen by a spec at construction; here the single-device model is
built and then transformed, so a reader sees what each parallelism changes.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from .config import ConfigError, ModelConfig, TrainConfig
from .cp import apply_context_parallel, check_context_parallel_config, check_context_parallel_seq_length
from .dp import apply_data_parallel, local_tensors, unwrap
from .fp8 import apply_fp8, fp8_recipe_of
from .grad_scaler import build_grad_scaler
from .optim import NormGroup, Optimizer, is_expert_parameter
from .moe import apply_expert_parallel, check_expert_parallel_config
from .parallel_state import Layout, check_grids
from .placement import gather_full_tensors
from .kernels import apply_kernels, available
from .pp import build_stage, check_schedule_args, stage_layers
from .recompute import apply_recompute
from .tp import apply_tensor_parallel, check_tensor_parallel_config

__all__ = ["validate_layout", "build_model", "build_optimizer", "layout_device", "unwrap", "full_model_tensors"]


def validate_layout(model_cfg: ModelConfig, cfg: TrainConfig, world_size: int) -> None:
    """ConfigError naming the fields and the numbers for any layout that cannot run: the world
    not divisible by tp x cp x pp, heads / groups / MLP by tp, layers by pp x chunks, the
    pipeline schedule's arguments, sequence parallelism without tp, the sequence by 2 cp (and
    by tp under SP), heads by the all-to-all size of cp, ZeRO combined with what it does not
    support here."""
    model_cfg.validate()
    cfg.validate(model_cfg)
    tp, pp, v = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, cfg.num_virtual_stages_per_pipeline_rank
    cp, sp = cfg.context_parallel_size, cfg.sequence_parallel
    if world_size % (tp * cp * pp):
        n = tp * cp * pp
        hint = (f"; start {n} (or a multiple of {n}) ranks with torchrun, e.g. `torchrun "
                f"--nproc_per_node={n} -m minimegatron.train --tensor-model-parallel-size {tp} "
                f"--context-parallel-size {cp} --pipeline-model-parallel-size {pp}`" if world_size == 1 else "")
        raise ConfigError(f"world size {world_size} is not divisible by tensor_model_parallel_size={tp} x "
                          f"context_parallel_size={cp} x pipeline_model_parallel_size={pp}{hint}")
    if tp > 1:
        check_tensor_parallel_config(model_cfg, tp)                     # heads, groups, ffn by tp
    check_expert_parallel_config(model_cfg, cfg, world_size)           # experts by ep, etp; SP with tp
    try:                                                                # the two grids agree on pp
        check_grids(world_size, tp=tp, pp=pp, cp=cp, ep=cfg.expert_model_parallel_size, etp=cfg.etp)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if sp and tp == 1:
        raise ConfigError("sequence_parallel with tensor_model_parallel_size=1: sequence parallelism cuts the regions "
                          "tensor parallelism leaves replicated, so it needs tp > 1 (Megatron ignores it at tp 1)")
    if cfg.overlap_sp_backward and not sp:
        raise ConfigError("overlap_sp_backward without sequence_parallel: it reorders sequence parallelism's "
                          "backward all-gather and reduce-scatter (tp without SP already overlaps its all-reduce)")
    if cfg.overlap_p2p_comm and pp == 1:
        raise ConfigError("overlap_p2p_comm with pipeline_model_parallel_size=1: there is no pipeline p2p to overlap")
    if sp and cfg.zero_stage >= 2:
        raise ConfigError(f"sequence_parallel with zero_stage={cfg.zero_stage}: the norms' gradients are summed over "
                          f"tp after the data-parallel reduction, which ZeRO-2/3 frees; use zero_stage 0 or 1")
    if cp > 1:
        try:
            check_context_parallel_seq_length(cfg.seq_length, cp)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        check_context_parallel_config(model_cfg.num_attention_heads // tp, model_cfg.query_groups // tp, cp,
                                      cfg.cp_comm_type, cfg.hierarchical_context_parallel_sizes,
                                      model_cfg.attention_dropout)
    if cfg.hierarchical_context_parallel_sizes is not None and cfg.cp_comm_type != "a2a+p2p":
        raise ConfigError(f"hierarchical_context_parallel_sizes={list(cfg.hierarchical_context_parallel_sizes)} "
                          f"is only used with cp_comm_type 'a2a+p2p', got {cfg.cp_comm_type!r}")
    if sp and (cfg.seq_length // cp) % tp:
        raise ConfigError(f"sequence_parallel: seq_length={cfg.seq_length} / context_parallel_size={cp} = "
                          f"{cfg.seq_length // cp} tokens per rank is not divisible by tensor_model_parallel_size={tp}")
    if cfg.main_grads_dtype is not None and cfg.zero_stage == 0 and cfg.ddp_impl == "naive":
        raise ConfigError(f"{'bf16' if cfg.bf16 else 'fp16 with accumulate_allreduce_grads_in_fp32'} keeps the "
                          f"gradients in a float32 buffer, which ddp_impl='naive' does not have; use 'bucketed'")
    if pp > 1 and cfg.zero_stage == 3:
        raise ConfigError(f"zero_stage=3 with pipeline_model_parallel_size={pp}: ZeRO-3's units (dp/fsdp.py) are "
                          f"not combined with pipeline stages here (the head's unit reads the tied embedding, which "
                          f"another stage holds); use zero_stage 1 or 2")
    if pp > 1 or v > 1:
        try:
            check_schedule_args(cfg.pipeline_schedule, pp, 0, cfg.grad_accum_steps, v)
        except ValueError as exc:
            raise ConfigError(f"pipeline_schedule={cfg.pipeline_schedule!r} with grad_accum_steps="
                              f"{cfg.grad_accum_steps} micro-batches: {exc}") from None
        stage_layers(model_cfg.num_layers, pp, 0, v)                     # layers by pp x chunks
    if cfg.kernels == "triton":
        _check_triton_kernels(model_cfg, cfg)
    if cfg.kernels == "compile":
        _check_compile(model_cfg, cfg)
    if cfg.recompute_granularity is not None and cfg.zero_stage == 3:
        raise ConfigError("recompute_granularity with zero_stage=3: ZeRO-3's units free a layer's weights after its "
                          "forward (dp/fsdp.py), and the recompute would run without them; use zero_stage 0, 1 or 2")
    per_chunk = model_cfg.num_layers // (pp * v)
    if cfg.recompute_granularity == "full" and not 1 <= cfg.recompute_num_layers <= per_chunk:
        raise ConfigError(f"recompute_num_layers={cfg.recompute_num_layers} must be between 1 and the {per_chunk} "
                          f"layers of a model chunk (num_layers={model_cfg.num_layers} / pp {pp} / chunks {v})")


def _check_triton_kernels(model_cfg: ModelConfig, cfg: TrainConfig) -> None:
    """What the Triton kernels (kernels/) cannot run, named."""
    why = available()
    d = model_cfg.kv_channels
    for bad, message in ((why is not None, why),
                         (model_cfg.attention_dropout > 0, f"attention_dropout={model_cfg.attention_dropout}: the "
                                                           f"Triton FlashAttention has no dropout"),
                         (cfg.context_parallel_size > 1, f"context_parallel_size={cfg.context_parallel_size}: the "
                                                         f"attention is context parallelism's own"),
                         (d & (d - 1) != 0 or (cfg.device == "cuda" and d < 16),
                          f"head size {d} (hidden_size / num_attention_heads): it must be a power of 2, and at least 16 "
                          f"on a GPU")):
        if bad:
            raise ConfigError(f"kernels='triton' with {message}")


def _check_compile(model_cfg: ModelConfig, cfg: TrainConfig) -> None:
    """What --kernels compile does not take, named: random masks (Inductor draws its own, so a
    compiled run would not equal the eager one), and the transformations that rewrite a layer's
    forward at run time (recompute, FP8's scale bookkeeping), which this book does not compile."""
    dropout = [f"{name}={getattr(model_cfg, name)}" for name in ("hidden_dropout", "attention_dropout")
               if getattr(model_cfg, name) > 0]
    for bad, message in ((dropout, f"{', '.join(dropout)}: Inductor draws its own random numbers, so the masks "
                                   f"would differ from the eager run's; use dropout 0"),
                         (cfg.recompute_granularity is not None, f"recompute_granularity={cfg.recompute_granularity!r}: "
                                                                 f"not compiled in this book"),
                         (cfg.fp8_format is not None, f"fp8_format={cfg.fp8_format!r}: FP8's scales are Python-side "
                                                      f"state, not compiled in this book")):
        if bad:
            raise ConfigError(f"kernels='compile' with {message}")


def build_model(model_cfg: ModelConfig, cfg: TrainConfig, layout: Layout,
                load: list[dict] | None = None) -> list[nn.Module]:
    """This rank's model chunks (one per virtual pipeline stage it holds; one without
    interleaving), each the one GPTModel transformed in the book's order. Every chunk starts
    from exactly the single-device weights of its layers (model/init.py), or from `load`
    (a resume: each chunk's saved state dict, loaded before the data-parallel wrapper
    takes the parameters); the layout validate_layout has passed. What each step installs is said
    at its line (docs/ARCHITECTURE.md §2); model.grad_finalizers(chunks) lists the hooks they registered."""
    if dist.is_initialized() and dist.get_world_size() != layout.world and not layout.is_alone:
        raise ValueError(f"layout.world={layout.world} but torch.distributed has {dist.get_world_size()} ranks: "
                         "build the layout with parallel_state.get_layout() (Layout() is one process)")
    v = cfg.num_virtual_stages_per_pipeline_rank
    chunks = []
    for c in range(v):
        # 1. pipeline (chapter 03): this chunk's layers; the embedding on virtual stage 0,
        #    the final norm, output layer and loss on the last one.
        #    Installs (pp > 1): grad_finalizers["tied-embedding"]; a tied copy's placement
        model = build_stage(model_cfg, layout, c, v, device=layout_device(cfg))
        # 2. tensor parallel (chapter 02): every matrix cut over the TP group; with sequence
        #    parallelism (chapter 04) the regions between them cut along the sequence.
        #    Installs: the plan's linears, embedding, output layer, loss replaced (each keeps its
        #    `gemm`), the placement splits, the `dropout_rng` seams; with SP the
        #    `sequence_parallel` marks and grad_finalizers["sequence-parallel"]
        model = apply_tensor_parallel(model, layout.tp_group, sequence_parallel=cfg.sequence_parallel,
                                      overlap_sp_backward=cfg.overlap_sp_backward)
        # 3. context parallel (chapter 04): attention over the sequence cut over the CP group.
        #    Installs: each SelfAttention.core_attention (a ContextParallelAttention)
        model = apply_context_parallel(model, layout.cp_group, cfg.cp_comm_type,
                                       a2a_group=layout.cp_a2a_group, p2p_group=layout.cp_p2p_group)
        # 4. expert parallel (chapter 05): each MoE layer's experts spread over the EP group, cut
        #    over the ETP group, reached through the token dispatcher.
        #    Installs: the other ranks' experts deleted, the etp slices, the `allreduce=False`
        #    marks, MoELayer.token_dispatcher / aux_group / aux_grad_scale,
        #    grad_finalizers["expert-bias"] given its group
        model = apply_expert_parallel(model, layout, cfg.moe_token_dispatcher_type)
        # 5. FP8 (chapter 06): the transformer layers' GEMMs in FP8, the amaxes of one-scale
        #    recipes reduced over the ranks that share a micro-batch (tp x cp; the experts' etp).
        #    Installs: each layer linear's `gemm` (an Fp8Gemm) and a forward pre-hook
        model = apply_fp8(model, fp8_recipe_of(cfg), layout.tp_cp_group, layout.etp_group)
        # 6. kernels (chapter 07): the norms, the attention core, SwiGLU and the loss as Triton
        #    programs, or each layer through torch.compile.
        #    Installs: the norms' `forward`, SelfAttention.core_attention, MLP.activation,
        #    GPTModel.output_and_loss; or each layer's compiled `forward`
        model = apply_kernels(model, cfg.kernels)
        # 7. activation recompute (chapter 07): whole layers in units, or the named parts of each,
        #    computed again in the backward instead of kept.
        #    Installs: TransformerBlock.forward (full), or the named parts' methods (selective)
        model = apply_recompute(model, cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers,
                                cfg.recompute_modules)
        if load is not None:
            model.load_state_dict(load[c])
        # 8. data parallel (chapter 01): gradients averaged over dp x cp, or sharded with ZeRO;
        #    the experts' summed over the expert-data-parallel group.
        #    Installs: the wrapper around the chunk (its buffers and gradient hooks) and its
        #    grad_finalizers["data-parallel"]
        model = apply_data_parallel(model, cfg, layout.dp_group, layout.expert_dp_group)
        chunks.append(model)
    return chunks


def layout_device(cfg: TrainConfig) -> torch.device:
    """Where this rank's model lives: the CPU, or with device="cuda" the GPU this rank
    selected (launch.init_from_torchrun: LOCAL_RANK), one per rank."""
    return torch.device("cpu") if cfg.device == "cpu" else torch.device("cuda", torch.cuda.current_device())


def build_optimizer(chunks: list[nn.Module], cfg: TrainConfig, layout: Layout) -> Optimizer:
    """One optim.Optimizer (AdamW) over every chunk's gradient source (the bare chunk, or its
    data-parallel wrapper: under ZeRO this rank's shards), whose gradient norm counts the dense
    parameters over the groups that split them (tp, pp) and a mixture's experts over theirs
    (etp, ep, pp); under ZeRO each also over the data-parallel group that shards it (dp x cp;
    the experts' expert-dp). Mixed precision (chapter 06): AdamW steps float32 main copies of
    the 16-bit parameters, and fp16 (or a constant loss_scale) scales the loss (grad_scaler.py)."""
    zero = cfg.zero_stage > 0
    precision = dict(main_params_dtype=torch.float32 if (cfg.bf16 or cfg.fp16) else None,
                     grad_scaler=build_grad_scaler(cfg))
    dense = NormGroup(groups=(layout.tp_group, layout.pp_group, *([layout.dp_group] if zero else [])),
                      tp_rank=layout.tp_rank)
    if unwrap(chunks[0]).config.num_experts is None or layout.world == 1:
        return Optimizer(chunks, cfg, [dense], **precision)
    experts = NormGroup(is_expert_parameter, (layout.etp_group, layout.ep_group, layout.pp_group,
                                              *([layout.expert_dp_group] if zero else [])), layout.etp_rank)
    return Optimizer(chunks, cfg, [dataclasses.replace(dense, select=lambda r: not is_expert_parameter(r)), experts],
                     **precision)


def full_model_tensors(chunks: list[nn.Module], layout: Layout, grads: bool = False) -> dict[str, torch.Tensor]:
    """The single-device model's parameters (or gradients, after finalize_model_grads), by
    single-device name and full shape, on every rank, read off the placement records: ZeRO's
    shards gathered (tag "inspect"), tensor-parallel splits all-gathered (tag "full"), a
    mixture's experts exchanged over ep and the pipeline's stages over pp
    (torch.distributed.all_gather_object: checkpoint plumbing, in no ledger), a pipeline's
    tied copy left out; saved buffers (a router's expert bias) copied. Collective over every
    rank."""
    mine: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        mine.update(gather_full_tensors(local_tensors(chunk, grads)))
        if not grads:                                                   # saved buffers (expert bias)
            model = unwrap(chunk)
            params = dict(model.named_parameters())
            mine.update({n: t.detach().clone() for n, t in model.state_dict().items() if n not in params})
    if layout.pp == 1:
        return mine
    parts = [None] * layout.pp
    dist.all_gather_object(parts, mine, group=layout.pp_group)
    return {name: t for part in parts for name, t in part.items()}
