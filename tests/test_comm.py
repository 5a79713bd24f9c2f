"""Tests for minimegatron.comm: every wrapper, the ledger, and the autograd regions.

All distributed checks run in ONE spawned world of 4 ranks (starting ranks is what costs
time). Every rank builds its inputs from (seed, rank), so every rank can rebuild every other
rank's inputs and compute the expected result on its own, without communication. Inputs are
integer-valued float64 so that sums are exact whatever order the collective adds in.

The rank function runs the ``@check`` functions below in order and returns, per check, None
or the failure's traceback; each check then becomes one pytest test that reads its entry.
"""


import pytest
import torch
import torch.distributed as dist

from minimegatron import comm
from minimegatron.comm import CommRecord, Ledger, record_communication, ring_traffic
from minimegatron.launch import spawn
from workers.checks import rank_failures, run_named_checks

WORLD = 4
CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


def make(seed, rank, *shape, dtype=torch.float64):
    """Rank ``rank``'s input for ``seed``: integer values in [-8, 8], any rank can rebuild it."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randint(-8, 9, shape, generator=g).to(dtype)


def equal(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    assert torch.equal(a, b), f"\n{a}\n!=\n{b}"


def only_record(ledger):
    assert len(ledger) == 1, ledger.records
    return ledger.records[0]


# ---------------------------------------------------------------------- plain collectives

@check
def check_all_reduce_ops_and_records(rank, G):
    for members, group in (((0, 1, 2, 3), G["world"]), (G["pair_ranks"], G["pair"])):
        inputs = [make(1, m, 3, 5) for m in members]
        expected = {"sum": sum(inputs), "avg": sum(inputs) / len(members),
                    "max": torch.stack(inputs).amax(0), "min": torch.stack(inputs).amin(0)}
        for op, want in expected.items():
            t = make(1, rank, 3, 5)
            with record_communication() as ledger:
                out = comm.all_reduce(t, group, op=op, tag="x")
            assert out is t  # in place
            torch.testing.assert_close(t, want, rtol=1e-15, atol=0)
            assert only_record(ledger) == CommRecord("all_reduce", members, 3 * 5 * 8,
                                                     torch.float64, (3, 5), "x")
    # async: recorded when issued, result valid after wait()
    t = make(2, rank, 4)
    with record_communication() as ledger:
        work = comm.all_reduce(t, G["world"], async_op=True)
        assert ledger.count("all_reduce") == 1
    work.wait()
    equal(t, sum(make(2, m, 4) for m in range(WORLD)))


@check
def check_all_reduce_on_three_of_four(rank, G):
    if rank == 0:
        return  # not a member of [1, 2, 3]
    t = make(3, rank, 7, dtype=torch.float32)
    comm.all_reduce(t, G["three"], op="avg")
    torch.testing.assert_close(t, sum(make(3, m, 7, dtype=torch.float32) for m in (1, 2, 3)) / 3)


@check
def check_single_member_groups_do_nothing_and_record_nothing(rank, G):
    solo = G["solo"]
    t = make(4, rank, 2, 3)
    before = t.clone()
    with record_communication() as ledger:
        assert comm.all_reduce(t, solo) is t
        assert comm.all_reduce(t, solo, async_op=True).wait()
        assert comm.all_gather(t, solo, dim=1) is t
        assert comm.reduce_scatter(t, solo) is t
        comm.broadcast(t, rank, solo)
        comm.barrier(solo)
        out = torch.empty(2, 3, dtype=torch.float64)
        comm.all_gather_into_tensor(out, t, solo)
        equal(out, before)
    equal(t, before)
    assert len(ledger) == 0


@check
def check_all_gather_into_tensor(rank, G):
    t = make(5, rank, 2, 3)
    out = torch.empty(WORLD * 2, 3, dtype=torch.float64)
    with record_communication() as ledger:
        comm.all_gather_into_tensor(out, t, G["world"])
    equal(out, torch.cat([make(5, m, 2, 3) for m in range(WORLD)]))
    assert only_record(ledger) == CommRecord("all_gather", (0, 1, 2, 3), 2 * 3 * 8,
                                             torch.float64, (2, 3), None)


@check
def check_all_gather_along_any_dim(rank, G):
    for dim in (0, 1, -1):
        got = comm.all_gather(make(6, rank, 2, 3, 4), G["world"], dim=dim)
        equal(got, torch.cat([make(6, m, 2, 3, 4) for m in range(WORLD)], dim=dim))
        assert got.is_contiguous()
    members = G["pair_ranks"]
    equal(comm.all_gather(make(7, rank, 3, 2), G["pair"], dim=1),
          torch.cat([make(7, m, 3, 2) for m in members], dim=1))


@check
def check_all_gather_uneven(rank, G):
    sizes = [1, 3, 2, 4]  # along dim 1
    with record_communication() as ledger:
        found = comm.all_gather(torch.tensor([sizes[rank]]), G["world"]).tolist()
        got = comm.all_gather(make(8, rank, 2, sizes[rank]), G["world"], dim=1, sizes=found)
    assert found == sizes
    equal(got, torch.cat([make(8, m, 2, sizes[m]) for m in range(WORLD)], dim=1))
    # the size exchange is counted too; the data gather sends the shard padded to 4 columns
    assert ledger.count("all_gather") == 2
    assert ledger.records[1].nbytes == 2 * 4 * 8


@check
def check_reduce_scatter(rank, G):
    full = [make(9, m, 8, 3) for m in range(WORLD)]
    out = torch.empty(2, 3, dtype=torch.float64)
    with record_communication() as ledger:
        comm.reduce_scatter_tensor(out, make(9, rank, 8, 3), G["world"])
    equal(out, sum(full)[2 * rank: 2 * rank + 2])
    assert only_record(ledger) == CommRecord("reduce_scatter", (0, 1, 2, 3), 8 * 3 * 8,
                                             torch.float64, (8, 3), None)
    got = comm.reduce_scatter(make(10, rank, 3, 8), G["world"], dim=1, op="avg")
    want = sum(make(10, m, 3, 8) for m in range(WORLD)) / WORLD
    torch.testing.assert_close(got, want[:, 2 * rank: 2 * rank + 2], rtol=1e-15, atol=0)
    with pytest.raises(ValueError, match="not divisible"):
        comm.reduce_scatter(torch.zeros(5), G["world"])


@check
def check_broadcast_uses_global_source_rank(rank, G):
    t = make(11, rank, 4)
    comm.broadcast(t, 2, G["world"])
    equal(t, make(11, 2, 4))
    src = G["pair_ranks"][1]  # a global rank: 2 in [0, 2], 3 in [1, 3]
    t = make(12, rank, 4)
    with record_communication() as ledger:
        comm.broadcast(t, src, G["pair"])
    equal(t, make(12, src, 4))
    assert only_record(ledger).op == "broadcast" and ledger.records[0].nbytes == 32
    with pytest.raises(ValueError, match="global rank"):
        comm.broadcast(t, 5, G["world"])


@check
def check_send_recv_isend_irecv(rank, G):
    nxt, prv = (rank + 1) % WORLD, (rank - 1) % WORLD
    got = torch.empty(3, dtype=torch.float64)
    with record_communication() as ledger:
        if rank % 2 == 0:  # even ranks send first: blocking pairs cannot deadlock
            comm.send(make(13, rank, 3), nxt)
            comm.recv(got, prv)
        else:
            comm.recv(got, prv)
            comm.send(make(13, rank, 3), nxt)
    equal(got, make(13, prv, 3))
    assert [r.op for r in ledger] == (["send", "recv"] if rank % 2 == 0 else ["recv", "send"])
    assert ledger.total_bytes("send") == ledger.total_bytes("recv") == 24
    got = torch.empty(5, dtype=torch.float64)
    works = [comm.irecv(got, prv), comm.isend(make(14, rank, 5), nxt)]
    for w in works:
        w.wait()
    equal(got, make(14, prv, 5))
    # inside a subgroup, peers are still named by global rank
    pair = G["pair_ranks"]
    other = pair[1] if rank == pair[0] else pair[0]
    got = torch.empty(2, dtype=torch.float64)
    works = [comm.isend(make(15, rank, 2), other, G["pair"]), comm.irecv(got, other, G["pair"])]
    for w in works:
        w.wait()
    equal(got, make(15, other, 2))


@check
def check_batch_isend_irecv(rank, G):
    nxt, prv = (rank + 1) % WORLD, (rank - 1) % WORLD
    from_prev = torch.empty(4, dtype=torch.float64)
    from_next = torch.empty(2, dtype=torch.float64)
    ops = [comm.P2POp("send", make(16, rank, 4), nxt),
           dist.P2POp(dist.isend, make(17, rank, 2), prv),  # torch's own P2POp also works
           comm.P2POp("recv", from_prev, prv),
           dist.P2POp(dist.irecv, from_next, nxt)]
    with record_communication() as ledger:
        for w in comm.batch_isend_irecv(ops):
            w.wait()
    equal(from_prev, make(16, prv, 4))
    equal(from_next, make(17, nxt, 2))
    assert [r.op for r in ledger] == ["send", "send", "recv", "recv"]
    assert ledger.total_bytes() == (4 + 2 + 4 + 2) * 8


@check
def check_all_to_all_single_even_and_uneven(rank, G):
    # rank r's block j is make(18, 10 * r + j, 2): each rank can rebuild every block
    t = torch.cat([make(18, 10 * rank + j, 2) for j in range(WORLD)])
    out = torch.empty_like(t)
    with record_communication() as ledger:
        comm.all_to_all_single(out, t, G["world"])
    equal(out, torch.cat([make(18, 10 * i + rank, 2) for i in range(WORLD)]))
    assert only_record(ledger) == CommRecord("all_to_all", (0, 1, 2, 3), 8 * 8,
                                             torch.float64, (8,), None)

    def split(src, dst):  # how many rows rank src sends to rank dst
        return (src + 2 * dst) % 3 + 1
    t = torch.cat([make(19, 10 * rank + j, split(rank, j)) for j in range(WORLD)])
    out = torch.empty(sum(split(i, rank) for i in range(WORLD)), dtype=torch.float64)
    comm.all_to_all_single(out, t, G["world"], in_splits=[split(rank, j) for j in range(WORLD)],
                           out_splits=[split(i, rank) for i in range(WORLD)])
    equal(out, torch.cat([make(19, 10 * i + rank, split(i, rank)) for i in range(WORLD)]))


@check
def check_all_to_all_plain(rank, G):
    x = [make(20, m, 3, 8) for m in range(WORLD)]
    got = comm.all_to_all(x[rank], G["world"], scatter_dim=1, gather_dim=0)
    equal(got, torch.cat([x[m][:, 2 * rank: 2 * rank + 2] for m in range(WORLD)], dim=0))


@check
def check_fp8_travels_as_bytes(rank, G):
    fp8 = torch.float8_e4m3fn
    def x(m):
        return (make(21, m, 2, 3, dtype=torch.float32) / 4).to(fp8)
    with record_communication() as ledger:
        got = comm.all_gather(x(rank), G["world"], dim=1)
        b = x(rank)
        comm.broadcast(b, 1, G["world"])
    assert got.dtype == fp8
    equal(got.view(torch.uint8), torch.cat([x(m) for m in range(WORLD)], dim=1).view(torch.uint8))
    equal(b.view(torch.uint8), x(1).view(torch.uint8))
    assert [(r.dtype, r.nbytes) for r in ledger] == [(fp8, 6), (fp8, 6)]
    with pytest.raises(TypeError, match="upcast"):
        comm.all_reduce(x(rank), G["world"])


@check
def check_barrier_and_nested_ledgers(rank, G):
    with record_communication() as outer:
        comm.barrier(G["world"], tag="sync")
        with record_communication() as inner:
            comm.all_reduce(torch.ones(10), G["pair"])
        comm.all_reduce(torch.ones(3), G["world"])
    assert [r.op for r in outer] == ["barrier", "all_reduce", "all_reduce"]
    assert [r.op for r in inner] == ["all_reduce"]
    assert outer.records[0] == CommRecord("barrier", (0, 1, 2, 3), 0, None, (), "sync")
    assert outer.total_bytes(group=G["pair"]) == outer.total_bytes(group=G["pair_ranks"]) == 40
    assert outer.total_bytes(group=G["world"]) == 12
    assert outer.count("all_reduce") == 2 and outer.total_bytes("all_reduce") == 52


# ---------------------------------------------------------------------- autograd regions

def region_case(rank, G, fn, x_shape, seed, **kw):
    """Run fn on this rank's x (requires grad) with upstream gradient dy; return the
    inputs of all ranks, y, x.grad and the ledger of forward + backward."""
    xs = [make(seed, m, *x_shape).requires_grad_() for m in range(WORLD)]
    x = xs[rank]
    with record_communication() as ledger:
        y = fn(x, G["world"], **kw)
        dys = [make(seed + 1, m, *y.shape) for m in range(WORLD)]
        y.backward(dys[rank])
    return [t.detach() for t in xs], dys, y.detach(), x.grad, ledger


def tags(ledger):
    return [(r.op, r.tag, r.nbytes) for r in ledger]


@check
def check_copy_and_reduce_regions(rank, G):
    xs, dys, y, grad, ledger = region_case(rank, G, comm.copy_to_tensor_model_parallel_region, (3, 4), 30)
    equal(y, xs[rank])
    equal(grad, sum(dys))  # identity forward -> the gradient sums over the members
    assert tags(ledger) == [("all_reduce", "bwd", 96)]
    xs, dys, y, grad, ledger = region_case(rank, G, comm.reduce_from_tensor_model_parallel_region, (3, 4), 32)
    equal(y, sum(xs))
    equal(grad, dys[rank])
    assert tags(ledger) == [("all_reduce", "fwd", 96)]


@check
def check_scatter_and_gather_regions(rank, G):
    cols = slice(2 * rank, 2 * rank + 2)
    xs, dys, y, grad, ledger = region_case(rank, G, comm.scatter_to_tensor_model_parallel_region, (3, 8), 34)
    equal(y, xs[rank][:, cols])
    equal(grad, torch.cat(dys, dim=-1))
    assert tags(ledger) == [("all_gather", "bwd", 3 * 2 * 8)]
    xs, dys, y, grad, ledger = region_case(rank, G, comm.gather_from_tensor_model_parallel_region, (3, 2), 36)
    equal(y, torch.cat(xs, dim=-1))
    equal(grad, dys[rank][:, cols])
    assert tags(ledger) == [("all_gather", "fwd", 3 * 2 * 8)]


@check
def check_sequence_parallel_regions(rank, G):
    rows = slice(2 * rank, 2 * rank + 2)
    xs, dys, y, grad, ledger = region_case(rank, G, comm.reduce_scatter_to_sequence_parallel_region, (8, 3), 38)
    equal(y, sum(xs)[rows])
    equal(grad, torch.cat(dys, dim=0))
    assert tags(ledger) == [("reduce_scatter", "fwd", 8 * 3 * 8), ("all_gather", "bwd", 2 * 3 * 8)]
    xs, dys, y, grad, ledger = region_case(rank, G, comm.gather_from_sequence_parallel_region, (2, 3), 40)
    equal(y, torch.cat(xs, dim=0))
    equal(grad, sum(dys)[rows])
    assert tags(ledger) == [("all_gather", "fwd", 2 * 3 * 8), ("reduce_scatter", "bwd", 8 * 3 * 8)]


@check
def check_all_to_all_region(rank, G):
    # x: (4 seq, 8 heads, 3); forward scatters heads and gathers sequence -> (16, 2, 3)
    xs, dys, y, grad, ledger = region_case(rank, G, comm.all_to_all_region, (4, 8, 3), 42,
                                           scatter_dim=1, gather_dim=0)
    equal(y, torch.cat([xs[m][:, 2 * rank: 2 * rank + 2] for m in range(WORLD)], dim=0))
    # x[:, heads of j] reached rank j as its rows 4*rank..4*rank+4, so its gradient is there
    equal(grad, torch.cat([dys[j][4 * rank: 4 * rank + 4] for j in range(WORLD)], dim=1))
    assert tags(ledger) == [("all_to_all", "fwd", 96 * 8), ("all_to_all", "bwd", 96 * 8)]


@check
def check_regions_are_adjoint(rank, G):
    """For each operator A: sum over ranks <A x, dy> == sum over ranks <x, A^T dy>.

    A replicated tensor (the input of copy/scatter, the output of reduce/gather_from) is
    one value held by every member: it is the same on every rank and counted once.
    """
    cases = [  # operator, shape of x, dims, input replicated, output replicated
        (comm.copy_to_tensor_model_parallel_region, (4, 4), {}, True, False),
        (comm.reduce_from_tensor_model_parallel_region, (4, 4), {}, False, True),
        (comm.scatter_to_tensor_model_parallel_region, (4, 4), {}, True, False),
        (comm.gather_from_tensor_model_parallel_region, (4, 4), {}, False, True),
        (comm.reduce_scatter_to_sequence_parallel_region, (4, 4), {}, False, False),
        (comm.gather_from_sequence_parallel_region, (4, 4), {}, False, False),
        (comm.all_to_all_region, (4, 8), {"scatter_dim": 1, "gather_dim": 0}, False, False)]
    n = 2  # members of G["pair"]
    for fn, shape, kw, x_replicated, y_replicated in cases:
        gx = torch.Generator().manual_seed(100 if x_replicated else rank)
        x = torch.randn(shape, dtype=torch.float64, generator=gx, requires_grad=True)
        y = fn(x, G["pair"], **kw)
        gy = torch.Generator().manual_seed(200 if y_replicated else 10 + rank)
        dy = torch.randn(y.shape, dtype=torch.float64, generator=gy)
        y.backward(dy)
        sides = torch.stack([(y.detach() * dy).sum() / (n if y_replicated else 1),
                             (x.detach() * x.grad).sum() / (n if x_replicated else 1)])
        dist.all_reduce(sides, group=G["pair"])
        torch.testing.assert_close(sides[0], sides[1], rtol=1e-12, atol=1e-12,
                                   msg=f"{fn.__name__} is not adjoint: {sides.tolist()}")


@check
def check_tensor_parallel_mlp_matches_the_full_one(rank, G):
    """f and g around a column-then-row parallel MLP give the full model's output and grads."""
    g = torch.Generator().manual_seed(0)
    x_full = torch.randn(5, 6, dtype=torch.float64, generator=g)
    w1 = torch.randn(6, 8, dtype=torch.float64, generator=g)
    w2 = torch.randn(8, 6, dtype=torch.float64, generator=g)
    dy = torch.randn(5, 6, dtype=torch.float64, generator=g)
    ref_x, ref_w1, ref_w2 = (t.clone().requires_grad_() for t in (x_full, w1, w2))
    (torch.tanh(ref_x @ ref_w1) @ ref_w2).backward(dy)

    cols = slice(2 * rank, 2 * rank + 2)
    x = x_full.clone().requires_grad_()
    w1_shard = w1[:, cols].clone().requires_grad_()  # column parallel
    w2_shard = w2[cols, :].clone().requires_grad_()  # row parallel
    h = torch.tanh(comm.copy_to_tensor_model_parallel_region(x, G["world"]) @ w1_shard)
    y = comm.reduce_from_tensor_model_parallel_region(h @ w2_shard, G["world"])
    y.backward(dy)
    torch.testing.assert_close(y, torch.tanh(x_full @ w1) @ w2, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w1_shard.grad, ref_w1.grad[:, cols], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w2_shard.grad, ref_w2.grad[cols, :], rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------- the spawned world

def run_checks():
    rank = dist.get_rank()
    # every rank creates every group, in the same order (a collective rule of new_group)
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    solos = [dist.new_group([r]) for r in range(WORLD)]
    three = dist.new_group([1, 2, 3])
    G = {"world": dist.group.WORLD, "pair": pairs[rank % 2], "pair_ranks": (rank % 2, rank % 2 + 2),
         "solo": solos[rank], "three": three}
    return run_named_checks(CHECKS, rank, G)


@pytest.fixture(scope="module")
def world_results():
    return spawn(run_checks, WORLD, timeout=120.0, collective_timeout=20.0)


@pytest.mark.parametrize("name", [fn.__name__ for fn in CHECKS])
def test_in_world_of_4(world_results, name):
    failures = rank_failures(world_results, name)
    assert not failures, failures


# ---------------------------------------------------------------------- no world needed

def test_ring_traffic_formulas():
    def rec(op, n, nbytes):
        return CommRecord(op, tuple(range(n)), nbytes, torch.float32, (nbytes // 4,))
    assert ring_traffic(rec("all_reduce", 4, 1000)) == 1500    # 2 * 3/4 * 1000
    assert ring_traffic(rec("all_reduce", 2, 1000)) == 1000    # 2 * 1/2 * 1000
    assert ring_traffic(rec("all_gather", 4, 1000)) == 3000    # 3 shards of 1000
    assert ring_traffic(rec("reduce_scatter", 4, 1000)) == 750
    assert ring_traffic(rec("all_to_all", 8, 800)) == 700
    assert ring_traffic(rec("send", 2, 64)) == 64 and ring_traffic(rec("recv", 2, 64)) == 0


def test_ledger_summaries_and_table():
    ledger = Ledger()
    ledger.records += [CommRecord("all_reduce", (0, 1), 400, torch.float32, (100,), "grads"),
                       CommRecord("all_gather", (0, 1, 2, 3), 40, torch.float32, (10,)),
                       CommRecord("all_reduce", (0, 1), 100, torch.float32, (25,), "grads")]
    assert ledger.count() == 3 and ledger.count("all_reduce") == 2
    assert ledger.total_bytes() == 540 and ledger.total_bytes("all_gather") == 40
    assert ledger.total_bytes(group=(0, 1)) == 500 and ledger.total_bytes(tag="grads") == 500
    assert ledger.ring_bytes() == 400 + 100 + 3 * 40 and ledger.ring_bytes("all_gather") == 120
    table = ledger.table()
    assert "all_reduce" in table and "[0, 1]" in table and "grads" in table
    assert table.splitlines()[-1].split() == ["total", "3", "540", "620"]


def test_without_a_process_group_everything_is_local():
    assert not dist.is_initialized()
    x = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    with record_communication() as ledger:
        y = comm.reduce_from_tensor_model_parallel_region(comm.copy_to_tensor_model_parallel_region(x, None), None)
        z = comm.gather_from_tensor_model_parallel_region(comm.scatter_to_tensor_model_parallel_region(y, None), None)
        z.sum().backward()
    equal(z.detach(), x.detach())
    equal(x.grad, torch.ones(2, 4, dtype=torch.float64))
    assert len(ledger) == 0
