"""Rank groups: xDiT's 16-device example exactly, and invariants for random meshes."""
import random

import pytest

from comfyui_hybrid_parallel.parallel import ParallelConfig, rank_coords, rank_groups


def test_seed_example_dp2_cfg2_pp2_sp2():
    g = rank_groups(ParallelConfig(dp_degree=2, cfg_degree=2, pp_degree=2, ulysses_degree=2))
    assert g["cfg"] == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert g["pp"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert g["sp"] == [[i, i + 1] for i in range(0, 16, 2)]
    assert g["ulysses"] == g["sp"]
    assert g["ring"] == [[i] for i in range(16)]
    assert g["dp"] == [[i, i + 8] for i in range(8)]
    assert g["tp"] == [[i] for i in range(16)]
    assert g["batch"] == [[i, i + 8, i + 4, i + 12] for i in range(4)]  # cfg-major: cond half first


def test_ulysses_inside_ring():
    g = rank_groups(ParallelConfig(ulysses_degree=2, ring_degree=2, tp_degree=2))
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["ulysses"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["ring"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # sp rank = ring_rank * ulysses_degree + ulysses_rank
    assert g["sp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]


def _random_configs(n=60, seed=0):
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        kw = dict(dp_degree=rng.choice([1, 2, 3]), cfg_degree=rng.choice([1, 2]),
                  ulysses_degree=rng.choice([1, 2, 4]), ring_degree=rng.choice([1, 2, 3]),
                  pp_degree=rng.choice([1, 2]), tp_degree=rng.choice([1, 2]))
        if kw["tp_degree"] > 1 and kw["pp_degree"] > 1:
            continue
        out.append(ParallelConfig(**kw))
    return out


@pytest.mark.parametrize("config", _random_configs(), ids=lambda c: c.describe())
def test_groups_partition_and_are_orthogonal(config):
    g = rank_groups(config)
    world = set(range(config.world_size))
    sizes = {"dp": config.dp_degree, "cfg": config.cfg_degree, "pp": config.pp_degree, "sp": config.sp_degree,
             "ring": config.ring_degree, "ulysses": config.ulysses_degree, "tp": config.tp_degree,
             "batch": config.cfg_degree * config.dp_degree}
    for axis, groups in g.items():
        flat = [r for grp in groups for r in grp]
        assert sorted(flat) == sorted(world), axis  # a partition
        assert all(len(grp) == sizes[axis] for grp in groups), axis
        for grp in groups:  # members differ only along this axis
            coords = [rank_coords(config, r) for r in grp]
            varying = {"sp": {"ulysses", "ring"}, "batch": {"cfg", "dp"}}.get(axis, {axis})
            for a in ("tp", "ulysses", "ring", "pp", "cfg", "dp"):
                if a not in varying:
                    assert len({c[a] for c in coords}) == 1, (axis, a, grp)
            if axis not in ("sp", "batch"):  # position in the group is the axis coordinate
                assert [c[axis] for c in coords] == list(range(len(grp)))
    # orthogonal: two different axes' groups share at most one rank
    single = ["dp", "cfg", "pp", "ring", "ulysses", "tp"]
    for i, a in enumerate(single):
        for b in single[i + 1:]:
            for ga in g[a]:
                for gb in g[b]:
                    assert len(set(ga) & set(gb)) <= 1
