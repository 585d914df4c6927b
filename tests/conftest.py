import os

import pytest

from dist_harness import DistPool

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def dist_pools():
    """get(n) -> a DistPool of n gloo ranks, spawned once per session and reused by every test."""
    pools = {}

    def get(n: int) -> DistPool:
        if n not in pools:
            pools[n] = DistPool(n)
        return pools[n]

    yield get
    for p in pools.values():
        p.close()
