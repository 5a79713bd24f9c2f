"""Tests for minimegatron.parallel_state.

Every expected table below is written by hand from Megatron-LM's documented semantics
(the leftmost dimension of the order string varies fastest), never from rank_groups itself.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from minimegatron import parallel_state as ps
from minimegatron.parallel_state import rank_coordinates, rank_groups
from minimegatron.viz import draw_rank_grid


# ---------------------------------------------------------------- rank_groups: tables

def test_megatron_docstring_example_16_ranks_tp2_pp4():
    # initialize_model_parallel's docstring in Megatron-LM: g0..g15, tp=2, pp=4 (dp=2).
    g = rank_groups(16, tp=2, pp=4)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert g["pp"] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert g["dp-cp"] == g["dp"]  # cp = 1
    assert g["cp"] == [[r] for r in range(16)]
    assert g["tp-pp"] == [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]
    assert g["tp-cp"] == g["tp"]
    assert g["tp-dp-cp"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert g["embedding"] == [[0, 12], [1, 13], [2, 14], [3, 15]]
    # experts: etp = tp = 2, ep = 1, expert_dp = 16 / (2*1*4) = 2
    assert g["etp"] == g["tp"]
    assert g["ep"] == [[r] for r in range(16)]
    assert g["expert-dp"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11],
                              [12, 14], [13, 15]]
    assert g["etp-ep"] == g["tp"]


def test_megatron_cp_docstring_example_8_ranks_tp4_cp2():
    # context_parallel_size doc: 8 GPUs, tp=4, cp=2 -> cp groups [0,4] [1,5] [2,6] [3,7].
    g = rank_groups(8, tp=4, cp=2)
    assert g["tp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert g["cp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["dp"] == [[r] for r in range(8)]       # dp = 1
    assert g["dp-cp"] == g["cp"]                    # gradients averaged over cp ranks
    assert g["tp-cp"] == [list(range(8))]
    assert g["pp"] == [[r] for r in range(8)]
    assert g["embedding"] == [[r] for r in range(8)]  # one stage: a single rank


def test_both_orders_8_ranks_tp2_pp2_dp2():
    # default tp-cp-ep-dp-pp: rank = tp + 2*dp + 4*pp
    g = rank_groups(8, tp=2, pp=2)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["tp-pp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert g["embedding"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # tp-cp-ep-pp-dp: rank = tp + 2*pp + 4*dp
    g = rank_groups(8, tp=2, pp=2, order="tp-cp-ep-pp-dp")
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["pp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["tp-pp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert g["tp-dp-cp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert g["expert-dp"] == g["dp"]


def test_16_ranks_tp2_cp2_dp2_pp2_with_experts():
    # rank = tp + 2*cp + 4*dp + 8*pp
    g = rank_groups(16, tp=2, cp=2, pp=2, ep=2)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert g["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert g["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert g["dp-cp"] == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert g["pp"] == [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]
    assert g["tp-cp"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert g["tp-pp"] == [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]]
    assert g["tp-dp-cp"] == [list(range(8)), list(range(8, 16))]
    assert g["embedding"] == g["pp"]
    # expert grid: etp=2, ep=2, expert_dp=16/(2*2*2)=2; rank = etp + 2*ep + 4*edp + 8*pp
    assert g["etp"] == g["tp"]
    assert g["ep"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert g["expert-dp"] == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14],
                              [11, 15]]
    assert g["etp-ep"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]


def test_expert_tensor_parallel_differs_from_tp():
    # etp=1, ep=4, pp=2 -> expert_dp = 16/(1*4*2) = 2; rank = ep + 4*edp + 8*pp
    g = rank_groups(16, tp=2, pp=2, ep=4, etp=1)
    assert g["etp"] == [[r] for r in range(16)]
    assert g["ep"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert g["etp-ep"] == g["ep"]
    assert g["expert-dp"] == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14],
                              [11, 15]]
    # the dense side does not change: tp=2, dp=4
    assert g["dp"] == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]


def test_groups_partition_the_world_with_ascending_ranks():
    for kwargs in [dict(tp=2, pp=4), dict(tp=2, cp=2, pp=2, ep=2), dict(tp=4, ep=2, etp=2),
                   dict(tp=2, pp=2, cp=2, ep=2, order="tp-cp-ep-pp-dp"), dict(pp=16)]:
        g = rank_groups(16, **kwargs)
        assert set(g) == {"tp", "cp", "dp", "dp-cp", "pp", "tp-cp", "tp-pp", "tp-dp-cp",
                          "embedding", "ep", "etp", "expert-dp", "etp-ep"}
        for key, groups in g.items():
            flat = sorted(r for grp in groups for r in grp)
            if key != "embedding":
                assert flat == list(range(16)), (kwargs, key)
                assert len({len(grp) for grp in groups}) == 1, (kwargs, key)
            assert all(grp == sorted(grp) for grp in groups), (kwargs, key)
            assert [grp[0] for grp in groups] == sorted(grp[0] for grp in groups)


def test_rank_coordinates_by_hand():
    # 16 ranks, tp=2 cp=2 dp=2 pp=2: 13 = 1 + 2*0 + 4*1 + 8*1
    c = rank_coordinates(13, 16, tp=2, cp=2, pp=2, ep=2)
    assert c == dict(tp_rank=1, cp_rank=0, dp_rank=1, dp_cp_rank=2, pp_rank=1,
                     etp_rank=1, ep_rank=0, expert_dp_rank=1)
    # tp-cp-ep-pp-dp, 8 ranks tp=2 pp=2 dp=2: 6 = 0 + 2*1 + 4*1
    c = rank_coordinates(6, 8, tp=2, pp=2, order="tp-cp-ep-pp-dp")
    assert (c["tp_rank"], c["pp_rank"], c["dp_rank"]) == (0, 1, 1)
    # etp=1, ep=4: 11 = ep 3 + 4*edp 0 + 8*pp 1
    c = rank_coordinates(11, 16, tp=2, pp=2, ep=4, etp=1)
    assert (c["etp_rank"], c["ep_rank"], c["expert_dp_rank"], c["pp_rank"]) == (0, 3, 0, 1)
    with pytest.raises(ValueError, match="rank=16"):
        rank_coordinates(16, 16, tp=2)


# ---------------------------------------------------------------- rank_groups: errors

@pytest.mark.parametrize("kwargs, words", [
    (dict(world_size=10, tp=4), ["10", "tp*pp*cp", "4"]),
    (dict(world_size=12, tp=2, pp=3, cp=4), ["12", "2*3*4", "24"]),
    (dict(world_size=8, tp=2, ep=3), ["8", "etp*ep*pp", "2*3*1", "6"]),
    (dict(world_size=8, tp=0), ["tp=0", ">= 1"]),
    (dict(world_size=8, ep=-2), ["ep=-2"]),
    (dict(world_size=8, tp=2, etp=0), ["etp=0"]),
    (dict(world_size=8, order="tp-dp-pp"), ["tp-dp-pp", "missing", "cp", "ep"]),
    (dict(world_size=8, order="tp-cp-ep-dp-dp"), ["repeated", "dp", "pp"]),
    (dict(world_size=8, order="tp-cp-xp-dp-pp"), ["xp", "ep"]),
    # pp before dp and dp != expert_dp: pipeline groups of the two grids disagree
    (dict(world_size=8, tp=2, pp=2, ep=2, order="tp-cp-ep-pp-dp"), ["pp", "2", "4"]),
])
def test_impossible_layouts_raise_value_error_naming_numbers(kwargs, words):
    world = kwargs.pop("world_size")
    with pytest.raises(ValueError) as info:
        rank_groups(world, **kwargs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_pp_first_order_is_fine_when_expert_dp_equals_dp():
    # etp*ep == tp*cp, so pp steps by the same stride in both grids
    g = rank_groups(8, tp=2, pp=2, ep=2, etp=1, order="tp-cp-ep-pp-dp")
    assert g["pp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["ep"] == [[0, 1], [2, 3], [4, 5], [6, 7]]


# ---------------------------------------------------------------- runtime

def test_getters_raise_before_initialization():
    ps.destroy_model_parallel()
    assert not ps.model_parallel_is_initialized()
    for getter in (ps.get_tensor_model_parallel_group, ps.get_pipeline_model_parallel_rank,
                   ps.get_data_parallel_world_size, ps.is_pipeline_first_stage,
                   ps.get_expert_data_parallel_rank, lambda: ps.get_group_ranks("tp")):
        with pytest.raises(RuntimeError, match="initialize_model_parallel"):
            getter()
    with pytest.raises(RuntimeError, match="init_process_group"):
        if dist.is_initialized():
            pytest.skip("a default process group already exists in this process")
        ps.initialize_model_parallel()


def test_layout_default_is_the_single_device():
    """Layout(): every size 1, every index 0, no process groups (comm then does nothing)."""
    layout = ps.Layout()
    assert (layout.world, layout.rank, layout.tp, layout.pp, layout.dp) == (1, 0, 1, 1, 1)
    assert (layout.tp_rank, layout.pp_rank, layout.dp_rank, layout.pp_ranks) == (0, 0, 0, (0,))
    assert (layout.tp_group, layout.pp_group, layout.dp_group, layout.embedding_group) == (None,) * 4
    with pytest.raises(dataclasses.FrozenInstanceError):   # a layout is not edited in place
        layout.tp = 2


def test_world_of_one_in_process():
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ps.initialize_model_parallel()
        assert ps.model_parallel_is_initialized()
        assert ps.get_tensor_model_parallel_world_size() == 1
        assert ps.get_data_parallel_rank(with_context_parallel=True) == 0
        assert ps.is_pipeline_first_stage() and ps.is_pipeline_last_stage()
        assert ps.get_group_ranks("embedding") == [0]
        layout = ps.get_layout()
        assert (layout.world, layout.rank, layout.tp, layout.pp, layout.dp) == (1, 0, 1, 1, 1)
        assert (layout.tp_rank, layout.pp_rank, layout.dp_rank, layout.pp_ranks) == (0, 0, 0, (0,))
        with pytest.raises(KeyError, match="tpp"):
            ps.get_group_ranks("tpp")
        with pytest.raises(RuntimeError, match="already initialized"):
            ps.initialize_model_parallel()
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


# Megatron-named getters for the keys that have one.
_GETTERS = {
    "tp": lambda: ps.get_tensor_model_parallel_group(),
    "pp": lambda: ps.get_pipeline_model_parallel_group(),
    "cp": lambda: ps.get_context_parallel_group(),
    "dp": lambda: ps.get_data_parallel_group(),
    "dp-cp": lambda: ps.get_data_parallel_group(with_context_parallel=True),
    "tp-pp": lambda: ps.get_model_parallel_group(),
    "tp-cp": lambda: ps.get_tensor_and_context_parallel_group(),
    "embedding": lambda: ps.get_embedding_group(),
    "ep": lambda: ps.get_expert_model_parallel_group(),
    "etp": lambda: ps.get_expert_tensor_parallel_group(),
    "expert-dp": lambda: ps.get_expert_data_parallel_group(),
    "etp-ep": lambda: ps.get_expert_tensor_and_model_parallel_group(),
}


def _groups_worker(layouts):
    """On every rank, for each layout: build the groups, and report for every key the
    torch group's members, an all-reduce of the members' ranks and the getters' answers."""
    rank = dist.get_rank()
    reports = []
    for kw in layouts:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=kw.get("tp", 1),
            pipeline_model_parallel_size=kw.get("pp", 1),
            context_parallel_size=kw.get("cp", 1), expert_model_parallel_size=kw.get("ep", 1),
            expert_tensor_parallel_size=kw.get("etp"), order=kw.get("order", "tp-cp-ep-dp-pp"))
        report = {"members": {}, "sums": {}, "getter_members": {}}
        for key in ps.KEYS:
            group = ps.get_group(key)
            if group is None:
                report["members"][key] = []
                continue
            report["members"][key] = dist.get_process_group_ranks(group)
            total = torch.tensor([float(rank)], dtype=torch.float64)
            dist.all_reduce(total, group=group)
            report["sums"][key] = total.item()
            if key in _GETTERS:
                report["getter_members"][key] = dist.get_process_group_ranks(_GETTERS[key]())
        report["coords"] = dict(
            tp_rank=ps.get_tensor_model_parallel_rank(), cp_rank=ps.get_context_parallel_rank(),
            dp_rank=ps.get_data_parallel_rank(),
            dp_cp_rank=ps.get_data_parallel_rank(with_context_parallel=True),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            etp_rank=ps.get_expert_tensor_parallel_rank(),
            ep_rank=ps.get_expert_model_parallel_rank(),
            expert_dp_rank=ps.get_expert_data_parallel_rank())
        report["sizes"] = (ps.get_tensor_model_parallel_world_size(),
                           ps.get_pipeline_model_parallel_world_size(),
                           ps.get_data_parallel_world_size(),
                           ps.get_expert_model_parallel_world_size())
        report["first_last"] = (ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage())
        layout = ps.get_layout()                        # the one object a step reads
        members = lambda g: [] if g is None else dist.get_process_group_ranks(g)  # noqa: E731
        report["layout"] = dict(
            world=layout.world, rank=layout.rank, sizes=(layout.tp, layout.pp, layout.dp),
            ranks=(layout.tp_rank, layout.pp_rank, layout.dp_rank), pp_ranks=list(layout.pp_ranks),
            groups={"tp": members(layout.tp_group), "pp": members(layout.pp_group),
                    "dp-cp": members(layout.dp_group), "embedding": members(layout.embedding_group)})
        reports.append(report)
        ps.destroy_model_parallel()
    return reports


RUNTIME_LAYOUTS = [
    dict(tp=2, pp=2),
    dict(tp=2, pp=2, order="tp-cp-ep-pp-dp"),
    dict(tp=2, cp=2, pp=2, ep=2, etp=1),
]
# The three small groups of the first two layouts, by hand (see the tables above).
HAND_TABLES = [
    {"tp": [[0, 1], [2, 3], [4, 5], [6, 7]], "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
     "pp": [[0, 4], [1, 5], [2, 6], [3, 7]]},
    {"tp": [[0, 1], [2, 3], [4, 5], [6, 7]], "pp": [[0, 2], [1, 3], [4, 6], [5, 7]],
     "dp": [[0, 4], [1, 5], [2, 6], [3, 7]]},
]


@pytest.mark.slow
def test_runtime_groups_on_8_ranks():
    launch = pytest.importorskip("minimegatron.launch",
                                 reason="minimegatron.launch (the spawn launcher) is missing")
    reports = launch.spawn(_groups_worker, 8, RUNTIME_LAYOUTS, timeout=300.0)
    for i, kw in enumerate(RUNTIME_LAYOUTS):
        layout = rank_groups(8, **kw)
        for rank in range(8):
            rep = reports[rank][i]
            for key, groups in layout.items():
                mine = [g for g in groups if rank in g]
                expected = mine[0] if mine else []
                assert rep["members"][key] == expected, (kw, rank, key)
                if expected:
                    assert rep["sums"][key] == sum(expected), (kw, rank, key)
                if key in _GETTERS and expected:
                    assert rep["getter_members"][key] == expected, (kw, rank, key)
                if i < len(HAND_TABLES) and key in HAND_TABLES[i]:
                    assert [g for g in HAND_TABLES[i][key] if rank in g] == [expected]
            assert rep["coords"] == rank_coordinates(rank, 8, **kw), (kw, rank)
            pp_rank = rep["coords"]["pp_rank"]
            assert rep["first_last"] == (pp_rank == 0, pp_rank == kw["pp"] - 1)
            # parallel_state.get_layout(): the same sizes, coordinates and groups
            lay, coords = rep["layout"], rep["coords"]
            assert (lay["world"], lay["rank"]) == (8, rank)
            assert lay["sizes"] == (kw.get("tp", 1), kw["pp"], len(rep["members"]["dp-cp"])), (kw, rank)
            assert lay["ranks"] == (coords["tp_rank"], coords["pp_rank"], coords["dp_cp_rank"]), (kw, rank)
            assert lay["groups"] == {k: rep["members"][k] for k in ("tp", "pp", "dp-cp", "embedding")}, (kw, rank)
            assert lay["pp_ranks"] == rep["members"]["pp"], (kw, rank)
    assert reports[0][0]["sizes"] == (2, 2, 2, 1)
    assert reports[0][2]["sizes"] == (2, 2, 1, 2)  # dp = 8/(2*2*2) = 1


# ---------------------------------------------------------------- the figure

def test_draw_rank_grid_colours_groups(tmp_path):
    from matplotlib.colors import same_color

    path = tmp_path / "grid.png"
    fig = draw_rank_grid(16, tp=2, pp=4, keys=("tp", "dp", "pp", "embedding"), path=path)
    assert path.stat().st_size > 1000
    assert len([ax for ax in fig.axes if ax.get_visible()]) == 4
    boxes = {p.get_gid(): p.get_facecolor() for ax in fig.axes for p in ax.patches}
    assert len(boxes) == 4 * 16
    same = lambda key, a, b: same_color(boxes[f"{key}:{a}"], boxes[f"{key}:{b}"])  # noqa
    assert same("tp", 0, 1) and not same("tp", 0, 2)
    assert same("dp", 0, 2) and not same("dp", 0, 1)
    assert same("pp", 0, 12) and not same("pp", 0, 1)
    assert same("embedding", 0, 12) and not same("embedding", 0, 4)
    assert same("embedding", 5, 6)  # middle stages: no group, the same grey
    texts = {t.get_text() for ax in fig.axes for t in ax.texts}
    assert {str(r) for r in range(16)} <= texts
    with pytest.raises(KeyError, match="nope"):
        draw_rank_grid(8, keys=("nope",))
