"""Text from a trained model: greedy and sampled decoding with a KV cache, on one device, under
tensor parallelism, across pipeline stages (chapter 08).

    python -m minimegatron.generate --load runs/ckpt --prompt "Pipeline" --max-new-tokens 40
    torchrun --nproc_per_node 2 -m minimegatron.generate --load runs/ckpt --tensor-model-parallel-size 2 \\
        --prompt "Pipeline" --prompt "A rank" --max-new-tokens 40 --temperature 0.8 --top-p 0.9 --seed 1
    torchrun --nproc_per_node 4 -m minimegatron.generate --load runs/ckpt --tensor-model-parallel-size 2 \\
        --pipeline-model-parallel-size 2 --prompt "Pipeline"

Shape legend as in model/gpt.py (b prompts, P the longest prompt, N new tokens, L layers, g
key/value heads, d head size, tp the tensor-parallel size).

**Without a cache** each new token runs the whole sequence through the model again: token t
costs a forward over t positions, N tokens cost about N P + N^2 / 2 positions.
**With the cache** (`KVCache`) each layer keeps the keys and values it already computed,
[b, g/tp, P + N, d] each, and a step runs only the new token: one position per step after the
prompt's one pass. The cache costs 2 L b (P + N) (g/tp) d e bytes per rank (`kv_cache_bytes`),
which under grouped-query attention is a/g times less than with a key and value per query head.

The cache enters the one model through its attention seam, as context parallelism does
(SelfAttention.core_attention): `CachedAttention` writes the step's k and v at their positions
and attends over every position written so far. q and k arrive with RoPE applied at the
positions generate passes in (position_ids), so a cached key never needs rotating again.

**Prompts of different lengths** are padded on the left to P tokens: a row's positions count
from its first real token, and a padded position is masked as a key for every query (each pad
query sees only itself, so no row of the softmax is empty). The last column of every row is
then the next token's logits, for every prompt at once.

**Under tensor parallelism** every rank holds its heads' slice of the cache and its vocabulary
slice of the logits; one all-gather of the last position's [b, Vp/tp] logits (tag "logits")
gives every rank the same full row, and the sampler, seeded alike, draws the same token
everywhere: the ranks never disagree on the sequence. Sequence parallelism is refused: a
one-token step cannot be cut along the sequence. Megatron's static batching does not take it
either (model_inference_wrappers/abstract_model_inference_wrapper.py); its dynamic batching cuts
the flattened tokens of all requests together instead.

**Across pipeline stages** each stage keeps the cache of its own layers. A step runs the stages
one after the other: each receives the previous stage's hidden states [b, s, h] and sends its
own to the next (comm.recv / comm.send), the last one chooses the tokens and broadcasts them
over the pipeline group (tag "token"), so every stage writes the same token into its sequence.
All stages but one wait at any moment: the pipeline bubble at its worst. Megatron's wrapper
runs the stages the same way (abstract_model_inference_wrapper.py,
forward_pass_with_pipeline_parallel, whose TODO is asynchronous micro-batches), and broadcasts
the last stage's logits rather than the tokens (communication_utils.py,
broadcast_from_last_pipeline_stage): b x V numbers where the book sends b.

Sampling (`next_token`), transformers' order: temperature, then top-k, then top-p (the
smallest set of the most likely tokens whose probability reaches p), then a draw from a
torch.Generator seeded by --seed; greedy (temperature 0) is the argmax. Megatron's sampler
(inference/sampling/torch_sampling.py, TorchSampling.sample_from_logits) refuses top-k and
top-p together, and its greedy is top_k == 1, the argmax whatever the temperature.
The book takes both together, and ignores them under greedy decoding (the command says so);
check_sampling refuses what cannot be sampled: a temperature that is negative, infinite or NaN,
a top-k below 1, a top-p outside (0, 1].

Megatron-LM (main d98e8a6, checked 2026-11-27): megatron/core/inference/ (engines/,
contexts/static_context.py's key_value_memory_dict, the dynamic engine's paged cache in
contexts/dynamic_context.py; sampling in text_generation_controllers/
text_generation_controller.py, sample_from_logits, which calls sampling/torch_sampling.py;
re-checked 2026-12-07).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import comm
from .config import ConfigError
from .dp import unwrap
from .resume import load_model

__all__ = ["KVCache", "CachedAttention", "cached_attention", "kv_cache_bytes", "check_sampling", "next_token",
           "generate", "load_model", "main"]


# ---------------------------------------------------------------------------------------
# the cache, through the attention seam
# ---------------------------------------------------------------------------------------
@dataclass
class KVCache:
    """The keys and values of every layer so far, and which positions hold real tokens.

    k[i], v[i]: [b, g, capacity, d] of layer i (g: the layer's key/value heads on this rank).
    filled: positions [0, filled) are written. key_valid: [b, capacity] bool, False at the
    left padding of shorter prompts."""
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    key_valid: torch.Tensor
    filled: int = 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


def kv_cache_bytes(num_layers: int, batch: int, length: int, kv_heads: int, head_dim: int, element_size: int) -> int:
    """2 L b (P + N) g d e: a key and a value per layer, prompt and new token, key/value head."""
    return 2 * num_layers * batch * length * kv_heads * head_dim * element_size


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_k: torch.Tensor,
                     cache_v: torch.Tensor, key_valid: torch.Tensor, start: int) -> torch.Tensor:
    """One decoding step's attention with a KV cache. q [b, a, s, d]: the queries of the s new
    positions [start, start + s); k, v [b, g, s, d]: their keys and values (RoPE applied);
    cache_k, cache_v [b, g, capacity, d]: this layer's cache, positions [0, start) already
    written; key_valid [b, capacity] bool: False where a position is left padding.
    Writes k, v into the cache at [start, start + s) (in place) and returns [b, a, s, d]:
    softmax(q K^T / sqrt(d)) V over the cached positions 0 .. its own for each query (causal),
    real keys only, except that a padding query attends to itself alone (so that no row of
    the softmax is empty); a/g query heads share each key/value head (grouped-query attention).
    With start 0 and s the whole sequence it is causal attention over that sequence."""
    # BEGIN EXERCISE 8.3: the KV cache's update and the attention over it | hint: the new keys go where the new positions are; each query may see every written key up to its own position, but not the padding; which mask says both, and how does SDPA share g key heads among a query heads?
    s = q.shape[2]
    end = start + s
    cache_k[:, :, start:end] = k                                                # [b, g, s, d]
    cache_v[:, :, start:end] = v
    keys, values = cache_k[:, :, :end], cache_v[:, :, :end]                     # [b, g, end, d]
    query_pos = torch.arange(start, end, device=q.device)                       # [s]
    key_pos = torch.arange(end, device=q.device)                                # [end]
    causal = key_pos[None, :] <= query_pos[:, None]                             # [s, end]
    own = key_pos[None, :] == query_pos[:, None]                                # a pad sees itself
    allowed = causal & (key_valid[:, None, :end] | own)                         # [b, s, end]
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed[:, None],
                                          enable_gqa=keys.shape[1] != q.shape[1])    # [b, a, s, d]
    # END EXERCISE


class CachedAttention:
    """SelfAttention.core_attention with layer `layer`'s slice of `cache` (cached_attention at
    the cache's fill level); generate advances cache.filled after the whole model ran."""

    def __init__(self, cache: KVCache, layer: int):
        self.cache, self.layer = cache, layer

    def __call__(self, q, k, v, dropout_p: float = 0.0, training: bool = False) -> torch.Tensor:
        c = self.cache
        return cached_attention(q, k, v, c.k[self.layer], c.v[self.layer], c.key_valid, c.filled)


# ---------------------------------------------------------------------------------------
# sampling
# ---------------------------------------------------------------------------------------
def check_sampling(max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
                   top_p: float | None = None, seed: int = 0) -> list[str]:
    """ConfigError naming the flag and its value for a request that cannot be sampled:
    max_new_tokens < 1, a temperature that is negative, infinite or NaN, top_k < 1, top_p
    outside (0, 1] (or NaN), a seed outside torch.Generator's [0, 2**64). Returns notes on
    what a valid request ignores: top_k and top_p under greedy decoding (temperature 0)."""
    def bad(flag, value, rule):
        raise ConfigError(f"{flag} {value}: {rule}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        bad("--max-new-tokens", max_new_tokens, "must be at least 1")
    if not (math.isfinite(temperature) and temperature >= 0):
        bad("--temperature", temperature, "must be 0 (greedy) or a positive finite number")
    if top_k is not None and top_k < 1:
        bad("--top-k", top_k, "must be at least 1 (1 keeps the likeliest token; leave it out to keep all)")
    if top_p is not None and not 0 < top_p <= 1:
        bad("--top-p", top_p, "must be in (0, 1] (1 keeps every token; leave it out to keep all)")
    if not 0 <= seed < 2**64:
        bad("--seed", seed, "must be in [0, 2**64)")
    if temperature == 0:
        return [f"{flag} {value} is ignored: --temperature 0 is greedy decoding, the argmax (give a temperature > 0 "
                f"to sample)" for flag, value in (("--top-k", top_k), ("--top-p", top_p)) if value is not None]
    return []


def next_token(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of `logits` [b, V]: the argmax when temperature is 0, else a draw from
    softmax(logits / temperature) restricted to the top_k most likely tokens and then to the
    smallest set of them whose probability reaches top_p. Returns [b] int64. The row's maximum
    is subtracted before the division, so that a tiny temperature cannot overflow to inf."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float()
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature                 # [b, V], max 0
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]        # [b, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        probs, order = logits.softmax(-1).sort(dim=-1, descending=True)               # [b, V]
        before = probs.cumsum(-1) - probs                                             # mass of the likelier ones
        drop = (before >= top_p).scatter(-1, order, before >= top_p)                  # back to vocabulary order
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


# ---------------------------------------------------------------------------------------
# the loop
# ---------------------------------------------------------------------------------------
@torch.no_grad()
def generate(model: nn.Module, prompts: list[list[int]], max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, seed: int = 0, use_cache: bool = True,
             tp_group=None, vocab_size: int | None = None, stop: int | None = None,
             pp_group=None) -> tuple[list[list[int]], dict]:
    """Continue each prompt (token ids; lengths may differ) by up to `max_new_tokens` tokens
    (fewer after `stop`, e.g. the tokenizer's eod). `model`: a GPTModel, or a tensor-parallel one
    (then `tp_group` and every rank of it call this alike), or a pipeline stage of one (then
    `pp_group` is its pipeline group, and every rank of it calls this alike). Returns (the new
    tokens of each prompt, {"kv_cache_bytes", "positions"}: the cache's bytes on this rank and
    the positions the model ran, a measure of the work). Communication under tp: the model's
    own, plus one comm.all_gather of the last position's logits per step (tag "logits"); under
    pp per step: each stage sends its hidden states [b, s, h] to the next (comm.send, tag
    "pp-fwd"), and the last stage broadcasts the chosen tokens [b] to the others (tag "token")."""
    check_sampling(max_new_tokens, temperature, top_k, top_p, seed)
    m = unwrap(model)
    cfg, device = m.config, next(m.parameters()).device
    pipeline = ((list(comm.group_ranks(pp_group)), comm.group_rank(pp_group))
                if pp_group is not None and comm.group_size(pp_group) > 1 else None)     # (stage ranks, this stage)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if getattr(m.output_layer, "sequence_parallel", False):
        raise ValueError("generation under sequence parallelism: a one-token step cannot be cut along the sequence; "
                         "load the model without --sequence-parallel")
    b, P = len(prompts), max(len(p) for p in prompts)
    total = P + max_new_tokens
    if total > cfg.max_position_embeddings:
        raise ValueError(f"the longest prompt ({P} tokens) + max_new_tokens ({max_new_tokens}) = {total} > the "
                         f"model's max_position_embeddings={cfg.max_position_embeddings}: at most "
                         f"{max(cfg.max_position_embeddings - P, 0)} new tokens after this prompt")
    V = vocab_size or cfg.vocab_size
    tokens = torch.zeros(b, total, dtype=torch.long, device=device)
    valid = torch.zeros(b, total, dtype=torch.bool, device=device)
    for i, p in enumerate(prompts):                                   # left padding
        tokens[i, P - len(p):P] = torch.tensor(p, device=device)
        valid[i, P - len(p):] = True
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)            # [b, total], 0 at the first real token
    generator = torch.Generator().manual_seed(seed)
    layers = [layer.self_attention for layer in m.decoder.layers.values()]
    cache, saved = None, [a.core_attention for a in layers]
    if use_cache:
        heads = [a.local_heads()[1] for a in layers]
        dtype = next(m.decoder.parameters()).dtype
        cache = KVCache([torch.zeros(b, g, total, cfg.kv_channels, dtype=dtype, device=device) for g in heads],
                        [torch.zeros(b, g, total, cfg.kv_channels, dtype=dtype, device=device) for g in heads], valid)
        for i, attention in enumerate(layers):
            attention.core_attention = CachedAttention(cache, i)
    new, done, ran = [[] for _ in prompts], torch.zeros(b, dtype=torch.bool), 0
    m.eval()
    try:
        for t in range(max_new_tokens):
            end = P + t
            start = 0 if cache is None else cache.filled               # no cache: the whole sequence again
            documents = _pads_apart(valid[:, :end]) if cache is None else None                  # pads masked
            logits = _stage_forward(m, pipeline, tokens[:, start:end], positions[:, start:end], documents)
            if cache is not None:
                cache.filled = end
            ran += end - start
            token = torch.zeros(b, dtype=torch.long, device=device)
            if logits is not None:                      # [b, s, V(/tp)] on the last stage (or the only one)
                last = logits[:, -1]                                                        # [b, V(/tp)]
                if tp_group is not None and comm.group_size(tp_group) > 1:
                    last = comm.all_gather(last.contiguous(), tp_group, dim=-1, tag="logits")   # [b, Vp]
                last = last[:, :V].float()
                if bool(torch.isfinite(last).all()):
                    token = next_token(last, temperature, top_k, top_p, generator)         # [b]
                else:
                    token.fill_(-1)                     # every stage learns it from the broadcast, none hangs
            if pipeline is not None:
                comm.broadcast(token, pipeline[0][-1], pp_group, tag="token")              # [b], to every stage
            if bool((token < 0).any()):
                raise ValueError(f"the model's logits at new token {t + 1} are not finite (NaN or inf): the "
                                 f"checkpoint's weights are not a trained model's")
            tokens[:, end] = token
            for i in range(b):
                if not done[i]:
                    new[i].append(int(token[i]))
                    done[i] = stop is not None and int(token[i]) == stop
            if bool(done.all()):
                break
    finally:
        for attention, core in zip(layers, saved):
            attention.core_attention = core
    return new, {"kv_cache_bytes": 0 if cache is None else cache.nbytes(), "positions": ran}


def _pads_apart(valid: torch.Tensor) -> torch.Tensor:
    """document_ids [b, s] (the packed-sequence mask of chapter 07) that mask the pads as keys:
    the real tokens are one document, each pad one of its own."""
    return torch.where(valid, 0, -1 - torch.arange(valid.shape[1], device=valid.device))


def _stage_forward(model: nn.Module, pipeline: tuple[list[int], int] | None, tokens: torch.Tensor,
                   positions: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor | None:
    """This rank's part of the model over tokens [b, s]: the logits [b, s, V(/tp)] on the last
    pipeline stage (or without a pipeline), None on the others. `pipeline`: (the global ranks of
    the pipeline group in stage order, this rank's stage), None for one stage. A stage after the
    first receives the previous stage's hidden states [b, s, h], one before the last sends its
    own (comm.recv / comm.send, tag "pp-fwd"); every stage knows b and s, so no shape travels."""
    if pipeline is None:
        return model(tokens, position_ids=positions, document_ids=document_ids)
    ranks, me = pipeline
    hidden = None
    if me > 0:
        b, s = tokens.shape
        hidden = torch.empty(b, s, model.config.hidden_size, dtype=next(model.decoder.parameters()).dtype,
                             device=tokens.device)
        comm.recv(hidden, ranks[me - 1], tag="pp-fwd")                                     # [b, s, h]
    out = model(tokens if me == 0 else None, position_ids=positions, hidden_states=hidden, document_ids=document_ids)
    if me == len(ranks) - 1:
        return out
    comm.send(out.contiguous(), ranks[me + 1], tag="pp-fwd")
    return None


# ---------------------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    from .checkpoint import CheckpointError
    from .data import build_tokenizer
    from .launch import finish_torchrun, init_from_torchrun
    parser = argparse.ArgumentParser(prog="python -m minimegatron.generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--load", required=True, help="a torch_dist checkpoint directory (any layout saved it)")
    parser.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    parser.add_argument("--max-new-tokens", type=int, default=32,
                        help="new tokens per prompt, at least 1; the longest prompt plus these must fit the model's "
                             "max_position_embeddings [default: 32]")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy, the argmax, which ignores --top-k and --top-p (and says so) [default]; "
                             "> 0: sample from softmax(logits / temperature)")
    parser.add_argument("--top-k", type=int, default=None,
                        help="sample among the k likeliest tokens, k >= 1 [default: all]. With --top-p too, top-k "
                             "applies first, then top-p, as in transformers (Megatron refuses the two together, and "
                             "its greedy decoding is top-k 1)")
    parser.add_argument("--top-p", type=float, default=None,
                        help="sample among the smallest set of likeliest tokens whose probability reaches p, "
                             "0 < p <= 1 [default: all]")
    parser.add_argument("--seed", type=int, default=0, help="the sampler's seed, 0 <= seed < 2**64 [default: 0]")
    parser.add_argument("--no-kv-cache", action="store_true", help="run the whole sequence at every step")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1, help="tp (under torchrun)")
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                        help="pp (under torchrun; the world is tp x pp ranks)")
    args = parser.parse_args(argv)
    rank, world = init_from_torchrun()
    try:
        tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
        notes = check_sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed)
        for flag, size in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp)):
            if size < 1:
                raise ConfigError(f"{flag} {size}: must be at least 1")
        if world != tp * pp:
            raise ConfigError(f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} needs "
                              f"{tp * pp} ranks; this run has {world}")
        model, model_cfg, spec, layout = load_model(args.load, tp, pp)
        tokenizer = build_tokenizer(spec)
        prompts = [tokenizer.encode(p) for p in args.prompt]
        for text, ids in zip(args.prompt, prompts):
            if not ids:
                raise ConfigError(f"--prompt {text!r} is empty: every prompt needs at least one token")
        if args.top_k is not None and args.top_k >= model_cfg.vocab_size and args.temperature > 0:
            notes.append(f"--top-k {args.top_k} keeps every token: the vocabulary has {model_cfg.vocab_size}")
        if rank == 0:
            for note in notes:
                print(f"note: {note}", file=sys.stderr)
        start = time.perf_counter()
        new, info = generate(model, prompts, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                             top_p=args.top_p, seed=args.seed, use_cache=not args.no_kv_cache,
                             tp_group=layout.tp_group if world > 1 else None, vocab_size=model_cfg.vocab_size,
                             stop=tokenizer.eod, pp_group=layout.pp_group if pp > 1 else None)
        seconds = time.perf_counter() - start
    except (CheckpointError, ConfigError, ValueError, OSError) as exc:     # OSError: an unreadable checkpoint file
        if rank == 0:
            print(f"error: {exc.strerror or exc}: {exc.filename}" if isinstance(exc, OSError) else f"error: {exc}",
                  file=sys.stderr)
        return finish_torchrun(2)
    if rank == 0:
        for prompt, tokens in zip(args.prompt, new):
            print(f"{prompt}{tokenizer.decode(tokens)}")
        count = sum(len(t) for t in new)
        cache = "no KV cache" if args.no_kv_cache else f"KV cache {info['kv_cache_bytes']:,} bytes on this rank"
        print(f"[{count} tokens in {seconds:.2f} s, {count / seconds:.1f} tokens/s; {cache}; "
              f"{info['positions']:,} positions run]")
    return finish_torchrun(0)


if __name__ == "__main__":
    sys.exit(main())
