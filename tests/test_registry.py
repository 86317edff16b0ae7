"""knitdata.registry: one idiom for every strategy table (engines, fetch modes, admission policies, placements)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from knitdata.admission import POLICIES, AdmissionPolicy, BatchSpec, FifoAdmission, make_policy
from knitdata.consumer.fetch import FETCH_MODES, FetchMode, SampleFetch, fetch_mode
from knitdata.engines.base import ENGINES, Engine
from knitdata.errors import ConfigError, OptionalDependencyError
from knitdata.placement import PLACEMENTS, IndexModPlacement, Placement, make_placement
from knitdata.registry import Registry


def test_register_get_names_and_the_error_naming_the_choices() -> None:
    reg: Registry[int] = Registry("number", accepts=lambda e: isinstance(e, int))
    assert reg.register("one", 1) == 1 and reg.register("two", 2) == 2
    assert reg.get("two") == 2 and reg.names() == ("one", "two") and list(reg) == ["one", "two"] and len(reg) == 2
    assert "one" in reg and "three" not in reg and 1 not in reg
    with pytest.raises(ConfigError, match=r"unknown number 'three'; choose one of \('one', 'two'\)"):
        reg.get("three")
    with pytest.raises(ConfigError, match="unknown number None"):
        reg.get(None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="number 'x': 1.5 is not a number"):
        reg.register("x", 1.5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="non-empty name"):
        reg.register("", 3)
    reg.register("one", 11)  # replaces, keeps its place
    assert reg.get("one") == 11 and reg.names() == ("one", "two")


def test_a_lazy_entry_is_imported_at_its_first_get() -> None:
    reg: Registry[type] = Registry("class", accepts=lambda e: isinstance(e, type))
    reg.register_lazy("ordered", "collections:OrderedDict")
    from collections import OrderedDict

    assert reg.get("ordered") is OrderedDict and reg.get("ordered") is OrderedDict
    with pytest.raises(ConfigError, match="'module:attribute'"):
        reg.register_lazy("bad", "collections.OrderedDict")
    reg.register_lazy("not_a_class", "collections:__name__")
    with pytest.raises(ConfigError, match="'not_a_class'.*is not a class"):
        reg.get("not_a_class")
    reg.register_lazy("missing", "knitdata_no_such_extra.mod:Thing")
    with pytest.raises(OptionalDependencyError, match="knitdata_no_such_extra") as e:
        reg.get("missing", what="the test")
    assert "the test needs" in str(e.value)


@given(st.lists(st.tuples(st.text(min_size=1, max_size=5), st.integers()), max_size=20))
def test_names_keep_the_order_of_first_registration_and_get_the_last_entry(pairs: list[tuple[str, int]]) -> None:
    reg: Registry[int] = Registry("number")
    for name, value in pairs:
        reg.register(name, value)
    assert reg.names() == tuple(dict.fromkeys(n for n, _ in pairs))
    last = dict(pairs)
    assert all(reg.get(n) == v for n, v in last.items())


def test_the_four_strategy_families_are_registries_of_one_idiom() -> None:
    """Engines, fetch modes, admission policies and placements: the same Registry, built-in names first, and one
    error naming the choices."""
    families = {ENGINES: ("embedded", "ray"), FETCH_MODES: ("sample", "eager", "iter"),
                POLICIES: ("train_batch", "fifo", "linear_target", "constraint_preserving"),
                PLACEMENTS: ("consumer_aware", "index_mod")}
    for reg, builtin in families.items():
        assert isinstance(reg, Registry) and reg.names()[:len(builtin)] == builtin
        with pytest.raises(ConfigError, match=f"unknown {reg.kind} 'nope'; choose one of"):
            reg.get("nope")
    assert issubclass(ENGINES.get("embedded"), Engine)
    assert isinstance(FETCH_MODES.get("sample"), FetchMode) and fetch_mode("sample") is FETCH_MODES.get("sample")
    assert all(issubclass(POLICIES.get(n), AdmissionPolicy) and POLICIES.get(n).name == n for n in POLICIES)
    assert all(issubclass(PLACEMENTS.get(n), Placement) and PLACEMENTS.get(n).name == n for n in PLACEMENTS)
    # each family refuses what is not one of its strategies
    for reg, wrong in ((ENGINES, int), (FETCH_MODES, object()), (POLICIES, Placement),
                       (PLACEMENTS, FifoAdmission)):
        with pytest.raises(ConfigError, match="is not a"):
            reg.register("wrong", wrong)
        assert "wrong" not in reg


def test_a_registered_strategy_is_chosen_by_name() -> None:
    """What a user registers is chosen by name like a built-in one (fetch mode, policy, placement)."""
    class Sample2(SampleFetch):
        name = "sample2"

    class Fifo2(FifoAdmission):
        name = "fifo2"

    class IndexMod2(IndexModPlacement):
        name = "index_mod2"

    try:
        FETCH_MODES.register(Sample2.name, Sample2())
        POLICIES.register(Fifo2.name, Fifo2)
        PLACEMENTS.register(IndexMod2.name, IndexMod2)
        assert fetch_mode("sample2").requests([["t0", "u0", 1], ["t1", "u0", 1]]) == 2
        assert isinstance(make_policy("fifo2", BatchSpec({"a": 2}, num_minibatches=1)), Fifo2)
        assert isinstance(make_placement("index_mod2", ["u0"]), IndexMod2)
        from knitdata import Pipeline

        pipe = Pipeline(BatchSpec({"a": 2}, num_minibatches=1), admission="fifo2", placement="index_mod2")
        assert pipe.internals.config["admission"] == "fifo2" and pipe.internals.config["placement"] == "index_mod2"
        pipe.shutdown()
    finally:  # leave the tables as they were for the other tests
        for reg, name in ((FETCH_MODES, "sample2"), (POLICIES, "fifo2"), (PLACEMENTS, "index_mod2")):
            reg.unregister(name)


def test_model_adapters_are_a_registry_of_the_same_idiom() -> None:
    """The fifth strategy table, ``model_type`` -> adapter class (``adapter_for``), is a Registry too: a model type
    registered by the user is adapted by its class; an unknown one is refused naming the choices."""
    import types

    import torch

    from knitdata.integrations.transformers import FAMILIES, MODEL_ADAPTERS, adapter_for

    assert isinstance(MODEL_ADAPTERS, Registry) and set(FAMILIES) - {"qwen2_5_omni"} <= set(MODEL_ADAPTERS)

    class Tiny(torch.nn.Module):
        config = types.SimpleNamespace(model_type="tiny_llava")

    made: list[tuple[object, object]] = []

    def tiny_adapter(model: object, processor: object) -> object:
        made.append((model, processor))
        return "adapter"

    with pytest.raises(ConfigError, match="no knitdata adapter for model_type 'tiny_llava'; supported: \\("):
        adapter_for(Tiny())
    try:
        MODEL_ADAPTERS.register("tiny_llava", tiny_adapter)  # type: ignore[arg-type]
        model = Tiny()
        assert adapter_for(model, processor="proc") == "adapter" and made == [(model, "proc")]
    finally:
        MODEL_ADAPTERS.unregister("tiny_llava")
    with pytest.raises(ConfigError, match="is not a model adapter"):
        MODEL_ADAPTERS.register("x", 3)  # type: ignore[arg-type]
