"""Bytes per diffusion step, from the comm counters, equal the analytic volume of each method (issue 10).

Volume, not time: the counters of every rank after one step must match the
exact formula of bench/comm_volume.py (per op and in total, within the issue's
±5 %, in practice exactly), and the image-attention part must match xDiT's table
times (N-1)/N. Fresh random inputs each run; one size per method does not divide
the degree (uneven shards and padding are part of the formula).
"""
import math
import os
import random
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))

import bench_pipefusion  # noqa: E402
import comm_volume as cv  # noqa: E402

pytestmark = pytest.mark.dist

CASES = [  # family, method, degrees, latent h, w, text, batch, steps
    ("sd3", "ulysses", dict(ulysses_degree=2), 16, 16, 8, 1, 1),
    ("flux", "ulysses", dict(ulysses_degree=4), 9, 11, 8, 1, 1),          # 99 tokens over 4
    ("sd3", "ring", dict(ring_degree=2), 30, 34, 8, 1, 1),                # 255 tokens over 2
    ("flux", "ring", dict(ring_degree=4), 8, 8, 8, 1, 1),
    ("sd3", "usp", dict(ulysses_degree=2, ring_degree=2), 30, 34, 8, 1, 1),
    ("flux", "distrifusion", dict(ulysses_degree=2, warmup_steps=1), 9, 11, 8, 1, 3),
    ("sd3", "tp", dict(tp_degree=2), 16, 16, 8, 1, 1),
    ("flux", "tp", dict(tp_degree=2), 9, 11, 8, 1, 1),
    ("pixart", "cfg", dict(cfg_degree=2), 34, 32, 8, 2, 1),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}{math.prod(c[2].values()) if c[1] != 'distrifusion' else 2}-{c[3]}x{c[4]}")
def test_measured_volume_equals_analytic(dist_pools, case):
    fam, method, deg, h, w, text, batch, steps = case
    n = math.prod(v for k, v in deg.items() if k.endswith("_degree"))
    res = dist_pools(n).run(cv.measure_body, fam, method, deg, h, w, text, batch, seed=random.randrange(10**6),
                            steps=steps)
    rows = cv.check(fam, method, deg, h, w, text, batch, res, steps)
    for r in rows:
        assert r["measured_bytes"] > 0, r
        assert abs(r["ratio"] - 1) <= 0.05 and r["worst_rank_dev"] <= 0.05, r
        assert r["per_op_exact"], r
        if r["image_vs_xdit"] is not None:  # the xDiT table's volume, up to padding of uneven shards
            assert abs(r["image_vs_xdit"] - 1) <= 0.05, r


def test_pipefusion_volume_equals_analytic(dist_pools):
    fam, pp, patches, h, w, text = "sd3", 2, 2, 16, 12, 7
    res = dist_pools(pp).run(bench_pipefusion._body, fam, pp, patches, h, w, text, 4)
    r = cv.pipefusion_row(fam, pp, patches, h, w, text, res)
    assert r["per_op_exact"] and abs(r["ratio"] - 1) <= 0.05, r
    assert r["image_vs_xdit"] == pytest.approx(1.0), r  # p·hs per stage boundary, xDiT's O(p·hs)
