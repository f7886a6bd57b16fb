"""The writer's paced collections (lowering/t2n/write.py): torch-to-nnef's full gc.collect()
after every quantized tensor becomes a full one at a pace set by its own cost, a young one
in between; and the writer module gets its own gc back after the call."""

from __future__ import annotations

import time

from gdn_fx.lowering.t2n import write


class FakeGc:
    """Records the generations asked for; a full collection takes ``cost`` seconds."""

    def __init__(self, cost: float):
        self.cost, self.asked = cost, []
        self.garbage = "kept"

    def collect(self, generation: int = 2) -> int:
        self.asked.append(generation)
        if generation == 2:
            time.sleep(self.cost)
        return 0


def test_full_collections_are_paced_by_their_own_cost():
    fake = FakeGc(cost=0.02)
    paced = write._PacedCollector(fake)
    for _ in range(20):  # much faster than 5 x 0.02 s apart
        paced.collect()
    assert fake.asked[0] == 2 and fake.asked.count(2) <= 2
    assert all(g in (0, 1, 2) for g in fake.asked) and len(fake.asked) == 20
    time.sleep(write.FULL_COLLECTION_PACE * 0.02 + 0.01)
    paced.collect()
    assert fake.asked[-1] == 2  # the pace has passed: a full one again
    assert paced.garbage == "kept"  # the rest of gc reads through


def test_young_collections_stay_young():
    fake = FakeGc(cost=0.0)
    write._PacedCollector(fake).collect(0)
    assert fake.asked == [0]


def test_the_writer_gets_its_gc_back():
    from torch_to_nnef.nnef_io import writer

    real = writer.gc
    with write._paced_collections():
        assert isinstance(writer.gc, write._PacedCollector)
    assert writer.gc is real
