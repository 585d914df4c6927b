"""SequenceSegments (parallel/plan.py): a per-segment table over the whole split sequence, cut to each rank's shard.

MiniMax H3 modulates its packed [text, audio, video] stream per segment, with a row per token where a noise mask
makes the video's modulation per token; each rank must get exactly its tokens' entries, counted from its shard's
start. Checked here on uneven shards against applying the table to the whole sequence and cutting the result."""
from types import SimpleNamespace

import pytest
import torch

from comfyui_hybrid_parallel.parallel.plan_inputs import _RunState, _sequence_segments


def _applied(sizes, rank):
    state = _RunState(seq_len=sum(sizes), seq_sizes=list(sizes))
    return SimpleNamespace(state=state, ctx=SimpleNamespace(sp=SimpleNamespace(rank=rank, size=len(sizes))))


def _apply(x, table, values):
    """The model's rule (comfy/ldm/minimax/model.py _mod_scale_shift): rows a:b scaled by values[row]."""
    out = x.clone()
    for a, b, row in table:
        out[a:b] = out[a:b] * values[row].unsqueeze(-1) if isinstance(row, torch.Tensor) else out[a:b] * values[row]
    return out


@pytest.mark.parametrize("sizes", [(21, 20), (14, 14, 13), (41, 0), (1, 40)])
def test_each_rank_gets_its_segments(sizes):
    n = sum(sizes)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(n, 3, generator=gen)
    values = torch.randn(9, generator=gen)
    per_token = torch.randint(0, 9, (18,), generator=gen)  # the video segment's rows, one per token
    table = [(0, 7, 1), (7, 23, 2), (23, 41, per_token)]
    whole = _apply(x, table, values)
    start = 0
    for rank, size in enumerate(sizes):
        local = _sequence_segments(table, _applied(sizes, rank), "test")
        assert all(0 <= a < b <= size for a, b, _ in local)
        assert sum(b - a for a, b, _ in local) == size  # contiguous cover of the shard
        torch.testing.assert_close(_apply(x[start:start + size], local, values), whole[start:start + size],
                                   rtol=0, atol=0)
        start += size


def test_a_table_that_does_not_cover_the_sequence_is_an_error():
    with pytest.raises(RuntimeError, match="does not cover"):
        _sequence_segments([(0, 30, 1)], _applied((21, 20), 0), "blocks.0:mod_segments")
