"""Graders of chapter 05, mixture of experts and expert parallelism: top-k routing with its
softmax before or after the choice (5.1), the load-balancing loss (5.2), the all-to-all chunk
re-sort (5.3) and the spot-the-bug experts' gradient group (5.4).

The oracles, strongest first: a GPT-MoE trained with expert parallelism 2 x expert-data
parallelism 2 on 4 ranks, your reduction_groups inside DistributedDataParallel (float64, AdamW,
clipping active), equals testing.single_device_run; the all-to-all dispatcher with your re-sort
inside, over 2 and 4 ranks, equals every expert run on one device token by token, forward and
backward (torch's autograd); routing and the loss written out here from their definitions
(Megatron-Core's topk_routing_with_score_function and switch_load_balancing_loss_func), with
Python loops where a vectorised oracle would repeat the code under test; and properties that
hold whatever the code (a permutation, a round trip, the minimum at uniform load, per-rank
losses that add up to the whole set's).

One spawned world of 4 ranks runs the distributed checks of 5.3 and 5.4 (those being graded),
each with its own function plugged into every rank (tests/workers/moe_graders.py;
booktools/exercises/world.py charges each failure to its own exercise).
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch import nn

from booktools.exercises import implementation
from booktools.exercises.world import SharedWorld
from minimegatron.config import TrainConfig
from minimegatron.launch import spawn
from minimegatron.moe.dispatcher import unsort_chunks_by_expert
from minimegatron.placement import set_placement
from minimegatron.testing import RunRecord, compare_runs, global_batches, single_device_run
from workers import moe_graders as W                    # tests/workers/moe_graders.py

WORLD = 4


@pytest.fixture(scope="module")
def world(graded_exercises):
    """One world of 4 ranks for the exercises being graded (in the order of grade_world's checks)."""
    return SharedWorld(lambda plan: spawn(W.grade_world, WORLD, plan, timeout=400, collective_timeout=60),
                       ["5.4", "5.3"], graded_exercises)


def _data(world, eid: str) -> list:
    return world.data(eid)


def _close(got, want, what: str, rtol=1e-10, atol=1e-12) -> None:
    assert got is not None and got.shape == want.shape, \
        f"{what}: shape {None if got is None else tuple(got.shape)}, expected {tuple(want.shape)}"
    diff = (got.to(torch.float64) - want.to(torch.float64)).abs().max().item() if got.numel() else 0.0
    assert torch.allclose(got.to(torch.float64), want.to(torch.float64), rtol=rtol, atol=atol), \
        f"{what}: max difference {diff:.3e}"


def _logits(T: int, E: int, seed: int, dtype=torch.float64) -> torch.Tensor:
    """Random logits [T, E] with distinct values in each row (no ties to break)."""
    g = torch.Generator().manual_seed(seed)
    return (2 * torch.randn(T, E, generator=g, dtype=torch.float64)).to(dtype)


# --------------------------------------------------------------------------------------
# 5.1 top-k routing, the softmax before or after the choice
# --------------------------------------------------------------------------------------
def _softmax(values: list[float]) -> list[float]:
    m = max(values)
    e = [math.exp(v - m) for v in values]
    return [x / sum(e) for x in e]


def _routing_by_hand(logits: torch.Tensor, k: int, pre_softmax: bool, num_groups=None, group_topk=None):
    """Megatron-Core's softmax routing, token by token in plain Python: the scores are the logits
    (default) or their softmax over all experts (pre_softmax); with groups, only experts of the
    group_topk groups with the largest sums of their k / group_topk best scores may be chosen;
    the k best allowed scores are chosen; the weights are the softmax over the k chosen logits
    (default) or the chosen probabilities as they are (pre_softmax). -> (probs, routing_map)."""
    T, E = logits.shape
    probs, routing_map = torch.zeros(T, E, dtype=torch.float64), torch.zeros(T, E, dtype=torch.bool)
    for t in range(T):
        row = [float(v) for v in logits[t]]
        scores = _softmax(row) if pre_softmax else row
        allowed = list(range(E))
        if group_topk:
            size = E // num_groups
            group_score = [sum(sorted(scores[g * size:(g + 1) * size], reverse=True)[:k // group_topk])
                           for g in range(num_groups)]
            best = sorted(range(num_groups), key=lambda g: -group_score[g])[:group_topk]
            allowed = [e for e in range(E) if e // size in best]
        chosen = sorted(allowed, key=lambda e: -scores[e])[:k]
        weights = [scores[e] for e in chosen] if pre_softmax else _softmax([row[e] for e in chosen])
        for e, w in zip(chosen, weights):
            probs[t, e], routing_map[t, e] = w, True
    return probs, routing_map


def _routing_oracle_autograd(logits: torch.Tensor, routing_map: torch.Tensor, pre_softmax: bool) -> torch.Tensor:
    """The probs as a differentiable function of the logits, given the (hand-checked) choice:
    softmax over the chosen logits only (default) or over all of them, kept on the chosen."""
    if pre_softmax:
        return torch.softmax(logits, dim=-1) * routing_map
    masked = logits.masked_fill(~routing_map, float("-inf"))
    return torch.softmax(masked, dim=-1).nan_to_num(0.0) * routing_map


CASES_51 = [(1, 4, 1), (7, 4, 2), (16, 8, 2), (9, 6, 3), (5, 8, 8), (12, 16, 4), (3, 2, 1)]


@pytest.mark.exercise("5.1")
@pytest.mark.parametrize("pre_softmax", [False, True], ids=["softmax-after-topk", "pre-softmax"])
@pytest.mark.parametrize("T,E,k", CASES_51, ids=[f"T{t}-E{e}-k{k}" for t, e, k in CASES_51])
def test_topk_routing_equals_the_routing_by_hand(T, E, k, pre_softmax):
    topk_routing = implementation("5.1")
    logits = _logits(T, E, seed=T * 100 + E * 10 + k)
    probs, routing_map = topk_routing(logits, k, pre_softmax=pre_softmax)
    want_probs, want_map = _routing_by_hand(logits, k, pre_softmax)
    what = f"topk_routing(T={T}, E={E}, k={k}, pre_softmax={pre_softmax})"
    assert routing_map.dtype == torch.bool and routing_map.shape == (T, E), \
        f"{what}: routing_map {routing_map.dtype} {tuple(routing_map.shape)}, expected torch.bool {(T, E)}"
    assert torch.equal(routing_map, want_map), \
        f"{what}: chose {routing_map.nonzero().tolist()}, expected (token, expert) {want_map.nonzero().tolist()}"
    _close(probs, want_probs, f"{what}: probs", rtol=1e-12, atol=1e-14)
    sums = probs.sum(-1)
    if pre_softmax:
        assert torch.all(sums <= 1 + 1e-12), f"{what}: weights summing to {sums.max().item()} > 1"
    else:
        _close(sums, torch.ones(T, dtype=torch.float64), f"{what}: each token's k weights should sum to 1")


@pytest.mark.exercise("5.1")
@pytest.mark.parametrize("pre_softmax", [False, True], ids=["softmax-after-topk", "pre-softmax"])
def test_topk_routing_gradient_reaches_the_logits_through_the_weights(pre_softmax):
    """d(sum probs * R)/d logits against autograd of the definition: with the softmax after the
    choice only the chosen logits get a gradient; with pre_softmax every logit does."""
    topk_routing = implementation("5.1")
    for T, E, k in [(6, 4, 2), (10, 8, 3), (4, 5, 1)]:
        logits = _logits(T, E, seed=7 * T + E).requires_grad_()
        R = torch.randn(T, E, generator=torch.Generator().manual_seed(T), dtype=torch.float64)
        probs, routing_map = topk_routing(logits, k, pre_softmax=pre_softmax)
        assert probs.requires_grad, "probs carry no gradient: the weights must be computed from the logits"
        (probs * R).sum().backward()
        ref = logits.detach().clone().requires_grad_()
        chosen = _routing_by_hand(ref.detach(), k, pre_softmax)[1]
        (_routing_oracle_autograd(ref, chosen, pre_softmax) * R).sum().backward()
        _close(logits.grad, ref.grad, f"T={T} E={E} k={k} pre_softmax={pre_softmax}: d/d logits")
        if not pre_softmax and k < E:
            assert logits.grad.masked_select(~routing_map).abs().max().item() == 0, \
                "with the softmax after the choice, the logits of experts not chosen get no gradient"


@pytest.mark.exercise("5.1")
@pytest.mark.parametrize("pre_softmax", [False, True], ids=["softmax-after-topk", "pre-softmax"])
@pytest.mark.parametrize("E,k,groups,group_topk", [(8, 2, 4, 2), (8, 4, 2, 1), (12, 3, 4, 3), (6, 2, 3, 1)])
def test_group_limited_routing_equals_the_routing_by_hand(E, k, groups, group_topk, pre_softmax):
    topk_routing = implementation("5.1")
    logits = _logits(11, E, seed=E + 31 * k + groups)
    probs, routing_map = topk_routing(logits, k, pre_softmax=pre_softmax, num_groups=groups, group_topk=group_topk)
    want_probs, want_map = _routing_by_hand(logits, k, pre_softmax, groups, group_topk)
    what = f"E={E} k={k} num_groups={groups} group_topk={group_topk} pre_softmax={pre_softmax}"
    assert torch.equal(routing_map, want_map), \
        f"{what}: chose {routing_map.nonzero().tolist()}, expected {want_map.nonzero().tolist()}"
    _close(probs, want_probs, f"{what}: probs", rtol=1e-12, atol=1e-14)


@pytest.mark.exercise("5.1")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_topk_routing_of_16_bit_logits_computes_in_float32(dtype):
    """The spec: scores and weights in float32 for 16-bit logits (as Megatron-Core does)."""
    topk_routing = implementation("5.1")
    logits = _logits(8, 6, seed=3, dtype=dtype)
    for pre_softmax in (False, True):
        probs, routing_map = topk_routing(logits, 2, pre_softmax=pre_softmax, scaling_factor=2.0)
        assert probs.dtype == torch.float32, f"pre_softmax={pre_softmax}: probs {probs.dtype}, expected float32"
        want_probs, want_map = _routing_by_hand(logits.float(), 2, pre_softmax)
        assert torch.equal(routing_map, want_map), f"pre_softmax={pre_softmax}: a different choice of experts"
        _close(probs, 2.0 * want_probs, f"pre_softmax={pre_softmax}, scaling_factor=2: probs", rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------------------
# 5.2 the load-balancing loss
# --------------------------------------------------------------------------------------
def _aux_loss_by_loops(logits, routing_map, k, coeff, score_function="softmax", tokens_per_expert=None,
                       num_tokens=None) -> float:
    """coeff * E / (k T^2) * sum_i (sum_t P[t, i]) * c_i, with Python loops: P the softmax of
    each token's logits over all experts (sigmoid: sigmoid scores divided by their sum), c_i the
    tokens routed to expert i (or tokens_per_expert), T the tokens (or num_tokens)."""
    T, E = logits.shape
    total = 0.0
    P = []
    for t in range(T):
        row = [float(v) for v in logits[t]]
        if score_function == "softmax":
            P.append(_softmax(row))
        else:
            s = [1 / (1 + math.exp(-v)) for v in row]
            P.append([x / sum(s) for x in s])
    n = T if num_tokens is None else num_tokens
    for i in range(E):
        c = (sum(int(routing_map[t, i]) for t in range(T)) if tokens_per_expert is None
             else float(tokens_per_expert[i]))
        total += sum(P[t][i] for t in range(T)) * c
    return coeff * E / (k * n * n) * total


def _routing_map(T: int, E: int, k: int, seed: int) -> torch.Tensor:
    """k distinct experts per token, at random (the loss is defined for any map)."""
    g = torch.Generator().manual_seed(seed)
    m = torch.zeros(T, E, dtype=torch.bool)
    for t in range(T):
        m[t, torch.randperm(E, generator=g)[:k]] = True
    return m


CASES_52 = [(8, 4, 2, 0.01), (13, 8, 2, 0.1), (5, 6, 1, 1.0), (16, 16, 4, 1e-3), (3, 2, 2, 0.5)]


@pytest.mark.exercise("5.2")
@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
@pytest.mark.parametrize("T,E,k,coeff", CASES_52, ids=[f"T{t}-E{e}-k{k}" for t, e, k, _ in CASES_52])
def test_aux_loss_equals_the_formula_written_out(T, E, k, coeff, score_function):
    aux_loss = implementation("5.2")
    logits = _logits(T, E, seed=T + E + k)
    routing_map = _routing_map(T, E, k, seed=T * E)
    got = aux_loss(logits, routing_map, k, coeff, score_function=score_function)
    assert got.dim() == 0, f"aux_loss returned shape {tuple(got.shape)}, expected a scalar"
    want = _aux_loss_by_loops(logits, routing_map, k, coeff, score_function)
    assert math.isclose(got.item(), want, rel_tol=1e-12, abs_tol=0), \
        f"T={T} E={E} k={k} coeff={coeff} {score_function}: aux_loss {got.item()!r}, expected {want!r}"


@pytest.mark.exercise("5.2")
def test_aux_loss_gradient_flows_through_the_scores_only():
    """d loss / d logits against autograd of the formula with the counts as constants."""
    aux_loss = implementation("5.2")
    T, E, k, coeff = 10, 6, 2, 0.05
    logits = _logits(T, E, seed=5).requires_grad_()
    routing_map = _routing_map(T, E, k, seed=6)
    aux_loss(logits, routing_map, k, coeff).backward()
    ref = logits.detach().clone().requires_grad_()
    counts = routing_map.sum(0).to(torch.float64)
    (coeff * E / (k * T * T) * (torch.softmax(ref, -1).sum(0) * counts).sum()).backward()
    _close(logits.grad, ref.grad, "d aux_loss / d logits", rtol=1e-10, atol=1e-15)


def _logits_with_scores(p: list[float], T: int) -> torch.Tensor:
    """T tokens whose softmax over the experts is exactly p (logits log p)."""
    return torch.tensor([math.log(x) for x in p], dtype=torch.float64).expand(T, -1).clone()


def _map_with_counts(counts: list[int], T: int, k: int) -> torch.Tensor:
    """A routing map with k distinct experts per token and counts[i] tokens on expert i."""
    m = torch.zeros(T, len(counts), dtype=torch.bool)
    slots = [i for i, c in enumerate(counts) for _ in range(c)]     # expert-major: a token's k slots differ
    for j, i in enumerate(slots):
        m[j % T, i] = True
    assert m.sum(1).eq(k).all() and m.sum(0).tolist() == counts
    return m


@pytest.mark.exercise("5.2")
def test_aux_loss_is_smallest_at_uniform_load():
    """Where the routed fractions follow the scores (c_i / kT = mean_t P[t, i] = p_i), the loss is
    coeff E sum_i p_i^2 (Cauchy-Schwarz: >= coeff), its minimum coeff exactly at p uniform; and
    with uniform counts it is coeff whatever the scores."""
    aux_loss = implementation("5.2")
    T, k, coeff = 8, 2, 0.3
    uniform, skewed, peaked = [0.25] * 4, [0.5, 0.25, 0.125, 0.125], [0.5, 0.375, 0.0625, 0.0625]
    losses = {}
    for name, p in [("uniform", uniform), ("skewed", skewed), ("peaked", peaked)]:
        counts = [round(x * k * T) for x in p]
        got = aux_loss(_logits_with_scores(p, T), _map_with_counts(counts, T, k), k, coeff).item()
        want = coeff * 4 * sum(x * x for x in p)
        assert math.isclose(got, want, rel_tol=1e-12), f"{name} load p={p}: loss {got!r}, expected {want!r}"
        losses[name] = got
    assert math.isclose(losses["uniform"], coeff, rel_tol=1e-12), \
        f"uniform load: loss {losses['uniform']!r}, expected its minimum coeff={coeff}"
    assert losses["uniform"] < losses["skewed"] < losses["peaked"], f"losses {losses}: not larger as the load skews"
    even = _map_with_counts([4, 4, 4, 4], T, k)
    for seed in range(3):
        got = aux_loss(_logits(T, 4, seed=seed), even, k, coeff).item()
        assert math.isclose(got, coeff, rel_tol=1e-12), \
            f"uniform counts, random scores (seed {seed}): loss {got!r}, expected coeff={coeff}"


@pytest.mark.exercise("5.2")
@pytest.mark.parametrize("parts", [2, 3, 4])
def test_per_rank_losses_with_the_whole_sets_counts_add_up_to_the_whole_loss(parts):
    """Cut T tokens over `parts` ranks: each rank's loss, given the whole set's tokens_per_expert
    and num_tokens, with its own logits; their sum (and the sum's gradient) is the whole loss's."""
    aux_loss = implementation("5.2")
    T, E, k, coeff = 12, 8, 2, 0.02
    logits = _logits(T, E, seed=parts).requires_grad_()
    routing_map = _routing_map(T, E, k, seed=parts + 50)
    whole = aux_loss(logits, routing_map, k, coeff)
    whole_grad, = torch.autograd.grad(whole, logits)
    assert math.isclose(whole.item(), _aux_loss_by_loops(logits.detach(), routing_map, k, coeff), rel_tol=1e-12), \
        "the loss of the whole set differs from the formula"
    counts = routing_map.sum(0)
    pieces = [aux_loss(lg, rm, k, coeff, tokens_per_expert=counts, num_tokens=T)
              for lg, rm in zip(logits.tensor_split(parts), routing_map.tensor_split(parts))]
    for i, (lg, rm) in enumerate(zip(logits.detach().tensor_split(parts), routing_map.tensor_split(parts))):
        want = _aux_loss_by_loops(lg, rm, k, coeff, tokens_per_expert=counts, num_tokens=T)
        assert math.isclose(pieces[i].item(), want, rel_tol=1e-12), \
            f"rank {i} of {parts}: loss {pieces[i].item()!r}, expected {want!r} (the whole set's counts and T)"
    total = sum(pieces)
    assert math.isclose(total.item(), whole.item(), rel_tol=1e-12), \
        f"{parts} ranks: the losses add up to {total.item()!r}, the whole set's loss is {whole.item()!r}"
    got_grad, = torch.autograd.grad(total, logits)
    _close(got_grad, whole_grad, f"{parts} ranks: the gradient of the summed losses", rtol=1e-10, atol=1e-15)


# --------------------------------------------------------------------------------------
# 5.3 the all-to-all chunk re-sort
# --------------------------------------------------------------------------------------
def _resort_brute_force(rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Label each row with its (source, local expert) by walking the chunks source-major, then
    sort the rows by (expert, source), keeping their order inside a chunk."""
    labels = [(s, j) for s in range(counts.shape[0]) for j in range(counts.shape[1]) for _ in range(int(counts[s, j]))]
    assert len(labels) == rows.shape[0]
    order = sorted(range(len(labels)), key=lambda i: (labels[i][1], labels[i][0], i))
    return rows[order]


def _counts(S: int, El: int, seed: int, empty: float = 0.3) -> torch.Tensor:
    rng = random.Random(seed)
    return torch.tensor([[0 if rng.random() < empty else rng.randint(1, 4) for _ in range(El)] for _ in range(S)])


CASES_53 = [(2, 2), (2, 4), (4, 2), (3, 5), (1, 3), (4, 1), (8, 3)]


@pytest.mark.exercise("5.3")
@pytest.mark.parametrize("S,El", CASES_53, ids=[f"S{s}-El{e}" for s, e in CASES_53])
def test_sort_chunks_equals_the_brute_force_resort_and_unsort_undoes_it(S, El):
    sort_chunks_by_expert = implementation("5.3")
    for seed in range(4):
        counts = _counts(S, El, seed=seed * 10 + S + El)
        R = int(counts.sum())
        rows = torch.arange(R * 3, dtype=torch.float64).view(R, 3)        # every row distinct
        got = sort_chunks_by_expert(rows, counts)
        want = _resort_brute_force(rows, counts)
        assert got.shape == want.shape and torch.equal(got, want), (
            f"counts {counts.tolist()}: rows in order {got[:, 0].div(3).long().tolist()}, expected "
            f"{want[:, 0].div(3).long().tolist()} (row numbers)")
        assert torch.equal(unsort_chunks_by_expert(got, counts), rows), \
            f"counts {counts.tolist()}: unsort_chunks_by_expert does not bring your order back"


@pytest.mark.exercise("5.3")
def test_sort_chunks_keeps_the_autograd_graph_and_handles_empty_chunks():
    sort_chunks_by_expert = implementation("5.3")
    counts = torch.tensor([[0, 3, 0], [2, 0, 1], [0, 0, 0], [1, 2, 0]])
    R = int(counts.sum())
    rows = torch.randn(R, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).requires_grad_()
    weights = torch.randn(R, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (sort_chunks_by_expert(rows, counts) * weights).sum().backward()
    assert rows.grad is not None, "no gradient reached the rows: the re-sort must stay differentiable"
    _close(rows.grad, unsort_chunks_by_expert(weights, counts), "d/d rows of (sorted * weights).sum()")
    none = torch.zeros(3, 2, dtype=torch.long)
    out = sort_chunks_by_expert(torch.zeros(0, 4, dtype=torch.float64), none)
    assert tuple(out.shape) == (0, 4), f"no rows at all: got shape {tuple(out.shape)}, expected (0, 4)"


def _dispatch_oracle(ep: int) -> list[dict]:
    """Every member of a group of `ep`: y[t] = sum_e probs[t, e] expert_e(tokens[t]) token by
    token on one device, with all E experts; the gradients of tokens, probs and every expert's
    weights for the members' douts together (autograd)."""
    inputs = [W.dispatch_inputs(ep, m) for m in range(ep)]
    experts = [W.expert(e) for e in range(W.E)]
    leaves, total = [], 0
    for inp in inputs:
        x, p = inp["tokens"].clone().requires_grad_(), inp["probs"].clone().requires_grad_()
        y = torch.stack([sum((p[t, e] * experts[e](x[t]) for e in inp["routing_map"][t].nonzero().flatten().tolist()),
                             torch.zeros(W.H, dtype=torch.float64)) for t in range(x.shape[0])])
        total = total + (y * inp["dout"]).sum()
        leaves.append((x, p, y.detach()))
    total.backward()
    grads = {e: {n: (q.grad if q.grad is not None else torch.zeros_like(q)) for n, q in m.named_parameters()}
             for e, m in enumerate(experts)}
    return [{"y": y, "dtokens": x.grad, "dprobs": p.grad, "expert_grads": grads} for x, p, y in leaves]


@pytest.mark.exercise("5.3")
def test_all_to_all_dispatcher_with_your_resort_equals_the_experts_on_one_device(world):
    per_rank = _data(world, "5.3")
    oracle = {ep: _dispatch_oracle(ep) for ep in (2, 4)}
    for rank, results in enumerate(per_rank):
        assert len(results) == 4, f"rank {rank}: {len(results)} dispatcher runs, expected 4"
        for r in results:
            want = oracle[r["ep"]][r["member"]]
            what = (f"rank {rank}, expert parallel {r['ep']} (member {r['member']}), "
                    f"{'grouped experts' if r['grouped'] else 'experts one at a time'}")
            _close(r["y"], want["y"], f"{what}: the output")
            _close(r["dtokens"], want["dtokens"], f"{what}: d/d tokens")
            _close(r["dprobs"], want["dprobs"], f"{what}: d/d probs")
            for e, named in r["expert_grads"].items():
                for n, g in named.items():
                    g = torch.zeros_like(want["expert_grads"][e][n]) if g is None else g
                    _close(g, want["expert_grads"][e][n], f"{what}: expert {e}'s {n} gradient")


# --------------------------------------------------------------------------------------
# 5.4 spot the bug: the experts' gradient group
# --------------------------------------------------------------------------------------
def _params(marks: list[bool | None]) -> list[nn.Parameter]:
    """Parameters of distinct sizes; True/False set `allreduce` in their placement records, None
    leaves the record as it is (no record: allreduce is True)."""
    out = []
    for i, mark in enumerate(marks):
        p = nn.Parameter(torch.zeros(i + 1))
        if mark is not None:
            set_placement(p, allreduce=mark)
        out.append(p)
    return out


def _indices(params, all_params) -> list[int]:
    """The positions in all_params of each of params (by identity)."""
    return [next(i for i, q in enumerate(all_params) if q is p) for p in params]


@pytest.mark.exercise("5.4")
@pytest.mark.parametrize("marks", [[None, False, True, False, None, False], [False, False, None],
                                   [None, True, None], [False]],
                         ids=["mixed", "experts-first", "dense-only", "one-expert"])
def test_reduction_groups_sends_experts_to_the_expert_dp_group(marks):
    reduction_groups = implementation("5.4")
    params = _params(marks)
    dp_group, expert_dp_group = object(), object()       # stand-ins: compared by identity
    got = reduction_groups(params, dp_group, expert_dp_group)
    assert isinstance(got, (list, tuple)) and len(got) == 2, f"expected [(dense, group), (experts, group)], got {got!r}"
    (dense, g_dense), (experts, g_experts) = got
    want_dense = [i for i, m in enumerate(marks) if m is not False]
    want_experts = [i for i, m in enumerate(marks) if m is False]
    assert _indices(dense, params) == want_dense, \
        f"marks {marks}: dense parameters {_indices(dense, params)}, expected {want_dense} (in the order of params)"
    assert _indices(experts, params) == want_experts, \
        f"marks {marks}: expert parameters {_indices(experts, params)}, expected {want_experts} " \
        "(in the order of params)"
    assert g_dense is dp_group, "the dense parameters must be reduced over dp_group"
    assert g_experts is expert_dp_group, \
        "the expert parameters (allreduce=False) must be reduced over expert_dp_group, not over " + \
        ("dp_group" if g_experts is dp_group else repr(g_experts))


@pytest.mark.exercise("5.4")
def test_reduction_groups_refuses_experts_without_an_expert_group():
    reduction_groups = implementation("5.4")
    dp_group = object()
    params = _params([None, False, True])
    with pytest.raises(ValueError):
        reduction_groups(params, dp_group, None)
    dense_only = _params([None, True])
    (dense, g), (experts, _) = reduction_groups(dense_only, dp_group, None)
    assert _indices(dense, dense_only) == [0, 1] and g is dp_group and list(experts) == [], \
        "a model without experts needs no expert group: every parameter is dense, over dp_group"


@pytest.mark.exercise("5.4")
def test_ep2_x_expert_dp2_training_with_your_groups_trains_like_one_device(world):
    per_rank = _data(world, "5.4")
    m, t = W.moe_model(), W.ep_train_config()
    ref_cfg = TrainConfig(**{**t.__dict__, "expert_model_parallel_size": 1})
    # one device sees the W.DP replicas' micro-batches of each step in turn
    ref = single_device_run(m, global_batches(m, t, dp=W.DP), ref_cfg, grad_accum_steps=t.grad_accum_steps * W.DP)
    expert_names = [n for n in ref.grads if ".experts." in n]
    assert expert_names, "the reference model has no expert parameters"
    for rank, out in enumerate(per_rank):
        assert len(out["ep_ranks"]) == 2 and len(out["expert_dp_ranks"]) == 2, \
            f"rank {rank}: ep group {out['ep_ranks']}, expert-dp group {out['expert_dp_ranks']}: expected 2 and 2"
        for n in expert_names:
            _close(out["grads"][n], ref.grads[n], f"rank {rank}: the first step's gradient of {n}",
                   rtol=1e-9, atol=1e-11)
        report = compare_runs(ref, RunRecord(out["losses"], out["grads"], out["params"]), m.dtype)
        assert report.ok, (f"rank {rank}: EP 2 x expert-DP 2 against one device: "
                           f"{report.problems[0] if report.problems else ''}\n(the run with your reduction_groups "
                           f"inside)\n{report}")
