"""Placement: consumer layout, consumer-aware spread by bytes with group affinity, index % units baseline."""

from __future__ import annotations

import os
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from knitdata.errors import ConfigError, StateError
from knitdata.placement import ConsumerAwarePlacement, ConsumerLayout, IndexModPlacement, make_placement
from knitdata.record import TrajectoryMeta

sys.path.insert(0, os.path.dirname(__file__))
from _state_harness import run_test_save_load_steps  # noqa: E402


def _meta(i: int, group: str, nbytes: int = 100) -> TrajectoryMeta:
    return TrajectoryMeta(id=f"t{i}", source="s", group=group, nbytes=nbytes, num_tokens=10, seq=i)


def test_layout():
    lay = ConsumerLayout.uniform(num_nodes=2, ranks_per_node=3)
    assert lay.num_consumers == 6 and lay.nodes == ("node0", "node1")
    assert lay.ranks_on("node1") == (3, 4, 5) and lay.node_of(2) == "node0"
    assert ConsumerLayout.from_dict(lay.to_dict()) == lay
    assert ConsumerLayout.single_node(3).nodes == ("node0",)
    with pytest.raises(ConfigError):
        ConsumerLayout([])
    with pytest.raises(ConfigError):
        lay.node_of(6)
    with pytest.raises(ConfigError):
        ConsumerLayout.single_node(0)


def test_index_mod_is_consumer_oblivious():
    p = make_placement("index_mod", ["a", "b", "c"])
    assert isinstance(p, IndexModPlacement) and not p.consumer_aware
    assert [p.place(_meta(i, "g")) for i in range(6)] == ["a", "b", "c", "a", "b", "c"]  # group ignored


def test_consumer_aware_spreads_bytes_and_keeps_groups():
    p = make_placement("consumer_aware", ["a", "b"])
    assert isinstance(p, ConsumerAwarePlacement) and p.consumer_aware
    placed = {}
    for i in range(40):
        g = f"g{i // 4}"
        placed.setdefault(g, set()).add(p.place(_meta(i, g, nbytes=100 + (i % 4) * 10)))
    assert all(len(units) == 1 for units in placed.values())  # a group stays on one unit
    load = p.state_dict()["load"]
    assert abs(load["a"] - load["b"]) <= 130  # spread by bytes (within one group's bytes)


def test_consumer_aware_ignores_releases_and_unplace_rebalances():
    """Placement counts bytes placed so far: releases (which depend on when consumers commit or restore) never
    move a later trajectory, so a restored run places, and plans, exactly as the uninterrupted one."""
    p = ConsumerAwarePlacement(["a", "b"])
    assert p.place(_meta(0, "g0", 1000)) == "a"
    assert p.place(_meta(1, "g1", 10)) == "b"
    assert p.place(_meta(2, "g2", 10)) == "b"
    p.released("a", 1000)
    assert p.place(_meta(3, "g3", 10)) == "b"  # "a" still counts its 1000 placed bytes
    p.unplace(_meta(3, "g3", 10), "b")  # a failed put is undone
    assert p.state_dict()["load"] == {"a": 1000, "b": 20}
    p.forget_group("g1")
    assert p.summary()["groups"] == 3 and len(p.state_dict()["groups"]) == 3


def test_unknown_placement():
    with pytest.raises(ConfigError):
        make_placement("random", ["a"])
    with pytest.raises(ConfigError):
        ConsumerAwarePlacement([])


@pytest.mark.parametrize("name", ["../etc", "a/b", "..", ".", "x\\y", "n\0"])
def test_node_names_cannot_escape_the_spill_directory(name):
    with pytest.raises(ConfigError, match="node name"):
        ConsumerLayout([name])


# ------------------------------------------------------------------------------------------- save/load

_OPS = st.lists(st.tuples(st.sampled_from(["place", "place_at", "unplace", "forget", "release"]),
                          st.integers(0, 5), st.integers(1, 500)), min_size=1, max_size=30)


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(["consumer_aware", "index_mod"]), ops=_OPS, max_groups=st.sampled_from([2, 65536]),
       data=st.data())
def test_placement_state_harness(name, ops, max_groups, data):
    """The shared save/load check (tests/_state_harness.py): a placement resumed between any two calls
    places every later put where the uninterrupted one does (loads, the bounded group table)."""
    units = ["a", "b", "c"]

    def make():
        if name == "consumer_aware":
            return ConsumerAwarePlacement(units, max_groups=max_groups)
        return make_placement(name, units)

    def step(i: int, op: str, g: int, nbytes: int):
        meta = _meta(i, f"g{g}", nbytes)

        def run(p):
            if op == "place":
                return p.place(meta)
            if op == "place_at":
                p.place_at(meta, units[g % 3])
                return p.view()
            if op == "unplace":
                p.unplace(meta, units[g % 3])
                return p.view()
            if op == "forget":
                p.forget_group(meta.group)
                return None
            p.released(units[g % 3], nbytes)
            return p.view()
        return run

    steps = [step(i, *op) for i, op in enumerate(ops)] + [step(len(ops) + j, "place", j, 50) for j in range(6)]
    mids = data.draw(st.lists(st.integers(0, len(steps)), min_size=1, max_size=4, unique=True))
    run_test_save_load_steps(make, steps, mids)


def test_placement_state_is_checked():
    p = ConsumerAwarePlacement(["a", "b"])
    p.place(_meta(0, "g"))
    with pytest.raises(StateError):
        ConsumerAwarePlacement(["a", "c"]).load_state_dict(p.state_dict())
    with pytest.raises(StateError):
        IndexModPlacement(["a"]).load_state_dict({"load": {}})
    q = ConsumerAwarePlacement(["a", "b"])
    q.load_state_dict(p.state_dict())
    assert q.state_dict() == p.state_dict() and q.summary() == p.summary() == {"load": {"a": 100, "b": 0}, "groups": 1}
