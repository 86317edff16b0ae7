"""knitdata.producer: the put path of a pipeline handle (checks in the producer, one round trip per unit, waits)."""

from __future__ import annotations

import os
import sys

import pytest

from knitdata.admission import BatchSpec
from knitdata.errors import FieldTypeError, PipelineClosedError, StoreFull, ValidationError
from knitdata.pipeline import Pipeline
from knitdata.placement import ConsumerLayout
from knitdata.producer import PUT_TIMEOUT, Producer, PutRouter

sys.path.insert(0, os.path.dirname(__file__))
from _ondemand_helpers import make_traj  # noqa: E402


def _pipe(**kw) -> Pipeline:
    return Pipeline(BatchSpec({"a": 4}, num_minibatches=2, group_size=2), num_consumers=2, token_budget=16, **kw)


def test_a_producer_puts_through_its_engine_and_counts_refusals_by_cause() -> None:
    pipe = _pipe()
    producer = Producer(pipe.internals, put_timeout=1.0, check_media=True)
    assert producer.put([], PUT_TIMEOUT) == []  # nothing: no round trip, not yet a producer
    metas = producer.put([make_traj(0, "a", "g0"), make_traj(1, "a", "g0")], PUT_TIMEOUT)
    assert [m.id for m in metas] == ["t0", "t1"] and all(m.location == "node0" for m in metas)
    with pytest.raises(FieldTypeError, match="put\\(\\) takes a knitdata.Trajectory"):
        producer.put(["not a trajectory"], PUT_TIMEOUT)  # type: ignore[list-item]
    with pytest.raises(ValidationError, match="token_budget") as e:
        producer.put([make_traj(2, "a", "g1", response_len=40)], PUT_TIMEOUT)
    assert e.value.trajectory_id == "t2" and e.value.field == "num_tokens"
    causes = pipe.stats_light()["rejected_by_cause"]
    assert causes.get("traj") == 1 and causes.get("num_tokens") == 1
    pipe.close()
    with pytest.raises(PipelineClosedError):
        producer.put([make_traj(3, "a", "g2")], PUT_TIMEOUT)
    pipe.shutdown()


def test_a_full_unit_refuses_after_the_timeout_naming_what_holds_it() -> None:
    pipe = _pipe(capacity_bytes=1, put_timeout=0)
    first = pipe.put(make_traj(0, "a", "g0"))  # an empty unit takes any payload
    assert first.location == "node0"
    with pytest.raises(StoreFull, match="storage unit 'node0' is held by"):
        pipe.put_many([make_traj(1, "a", "g0"), make_traj(2, "a", "g1")])
    assert pipe.stats_light()["rejected_by_cause"].get("store_full") == 2  # both refused, the first kept
    pipe.shutdown()


def test_the_router_keeps_a_group_on_one_unit_and_follows_the_plane() -> None:
    pipe = Pipeline(BatchSpec({"a": 4}, num_minibatches=1, group_size=2), layout=ConsumerLayout.uniform(2, 1),
                    token_budget=16)
    router = PutRouter(pipe.internals)
    metas = [make_traj(i, "a", f"g{i // 2}").meta().to_dict() for i in range(4)]
    units = router.route(metas)
    assert units[0] == units[1] and units[2] == units[3] and set(units) <= set(pipe.units)
    for t in (make_traj(i, "a", f"g{i // 2}") for i in range(4)):
        assert pipe.put(t).location is not None
    pipe.shutdown()


def test_check_media_off_skips_decoding_in_the_producer() -> None:
    """With ``check_media`` a payload that does not decode is refused at put (naming it); without, it is stored
    (decoded, and refused, only where it is collated)."""
    from knitdata.errors import MediaError
    from knitdata.record import MediaItem

    def bad(i: int):
        t = make_traj(i, "a", "g0")
        t.media = [MediaItem(kind="image", data=b"not an image")]
        return t

    pipe = _pipe()
    with pytest.raises(MediaError, match="t0"):
        pipe.put(bad(0))
    assert pipe.stats_light()["rejected_by_cause"].get("media") == 1
    unchecked = Producer(pipe.internals, put_timeout=1.0, check_media=False)
    assert [m.id for m in unchecked.put([bad(1)], PUT_TIMEOUT)] == ["t1"]
    pipe.shutdown()


def test_media_checked_once_per_digest_and_references_not_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 43: a group's shared image is decoded once per put; a reference (no content) is not checked."""
    import io

    import torch
    from PIL import Image

    import knitdata.media.process as media_mod
    from knitdata.errors import MediaRefError
    from knitdata.record import MediaItem, Trajectory

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (1, 2, 3)).save(buf, format="PNG")
    png = MediaItem("image", data=buf.getvalue())
    calls: list[str] = []
    real = media_mod.check_media_item
    monkeypatch.setattr(media_mod, "check_media_item", lambda item, **kw: (calls.append(item.digest), real(item, **kw)))

    def member(k: int, item: MediaItem) -> Trajectory:
        return Trajectory(id=f"m{k}", source="a", group=f"g{k // 2}", prompt_ids=torch.arange(4),
                          response_ids=torch.arange(4), media=[item])

    pipe = _pipe()
    pipe.put_many([member(0, png), member(1, MediaItem("image", data=bytes(png.data)))])  # equal content twice
    assert calls == [png.digest]
    pipe.put(member(2, MediaItem.ref("image", png.digest)))  # another group refers to it
    assert calls == [png.digest]
    with pytest.raises(MediaRefError):
        pipe.put(member(3, MediaItem.ref("image", "9" * 32)))
    pipe.put(member(3, png))
    assert pipe.stats_light()["rejected_by_cause"].get("media") == 1
    pipe.shutdown()
