"""Tests of knitdata.record: every validation path names the trajectory and the field."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from knitdata.errors import FieldTypeError, KnitdataError, ValidationError
from knitdata.record import MediaItem, Trajectory, TrajectoryMeta, metas_by_group, tensor_digest


def make(**kw) -> Trajectory:
    base = dict(
        id="t1",
        source="math",
        group="g1",
        prompt_ids=torch.tensor([1, 2, 3]),
        response_ids=torch.tensor([4, 5]),
        gen_version=3,
    )
    base.update(kw)
    return Trajectory(**base)


@pytest.mark.parametrize(
    ("kw", "err", "field"),
    [
        ({"id": ""}, ValidationError, "id"),
        ({"id": "a.b"}, ValidationError, "id"),
        ({"id": "a/b"}, ValidationError, "id"),
        ({"source": ""}, ValidationError, "source"),
        ({"group": 7}, ValidationError, "group"),
        ({"gen_version": -1}, ValidationError, "gen_version"),
        ({"gen_version": 1.5}, ValidationError, "gen_version"),
        ({"gen_version": True}, ValidationError, "gen_version"),
        ({"prompt_ids": [1, 2]}, FieldTypeError, "prompt_ids"),
        ({"prompt_ids": torch.tensor([1.0])}, FieldTypeError, "prompt_ids"),
        ({"prompt_ids": torch.zeros(2, 2, dtype=torch.long)}, ValidationError, "prompt_ids"),
        ({"response_ids": torch.tensor([], dtype=torch.long)}, ValidationError, "response_ids"),
        ({"response_ids": torch.tensor([0.5, 1.0])}, FieldTypeError, "response_ids"),
        ({"prompt_ids": torch.tensor([1, -1, 3])}, ValidationError, "prompt_ids"),  # new-user audit: accepted
        ({"response_ids": torch.tensor([-1, 3])}, ValidationError, "response_ids"),
        ({"response_ids": torch.tensor([4, -7], dtype=torch.int32)}, ValidationError, "response_ids"),
        ({"loss_mask": torch.ones(3)}, ValidationError, "loss_mask"),
        ({"loss_mask": [1, 1]}, FieldTypeError, "loss_mask"),
        ({"loss_mask": torch.tensor([1.0, math.nan])}, ValidationError, "loss_mask"),
        ({"token_versions": torch.tensor([3])}, ValidationError, "token_versions"),
        ({"token_versions": torch.tensor([4, 5])}, ValidationError, "gen_version"),
        ({"token_versions": torch.tensor([3.0, 4.0])}, FieldTypeError, "token_versions"),
        ({"scalars": {"reward": math.nan}}, ValidationError, "scalars.reward"),
        ({"scalars": {"reward": math.inf}}, ValidationError, "scalars.reward"),
        ({"scalars": {"reward": "1"}}, FieldTypeError, "scalars.reward"),
        ({"scalars": {"reward": True}}, FieldTypeError, "scalars.reward"),
        ({"scalars": [1]}, FieldTypeError, "scalars"),
        ({"tensors": {"logp": [1.0]}}, FieldTypeError, "tensors.logp"),
        ({"tensors": {"logp": torch.tensor([math.inf])}}, ValidationError, "tensors.logp"),
        ({"tensors": {"loss_mask": torch.ones(2)}}, ValidationError, "tensors.loss_mask"),
        ({"media": ["img"]}, FieldTypeError, "media[0]"),
        ({"media": "img"}, FieldTypeError, "media"),
    ],
)
def test_validation_errors_name_trajectory_and_field(kw, err, field) -> None:
    with pytest.raises(err) as exc:
        make(**kw)
    assert isinstance(exc.value, KnitdataError)
    assert exc.value.field == field
    if field != "id":
        assert exc.value.trajectory_id == "t1"
        assert "'t1'" in str(exc.value)
    assert repr(field) in str(exc.value)


def test_error_classes_derive_from_builtins() -> None:
    with pytest.raises(ValueError):
        make(response_ids=torch.tensor([], dtype=torch.long))
    with pytest.raises(TypeError):
        make(prompt_ids=[1])


@pytest.mark.parametrize(
    ("kw", "err"),
    [
        ({"kind": "hologram", "data": b"x"}, ValidationError),
        ({"kind": "image"}, ValidationError),
        ({"kind": "image", "data": b"x", "tensor": torch.zeros(1)}, ValidationError),
        ({"kind": "image", "tensor": [1, 2]}, FieldTypeError),
        ({"kind": "audio", "data": "abc"}, FieldTypeError),
        ({"kind": "audio", "data": b"x", "sample_rate": 0}, ValidationError),
    ],
)
def test_media_item_validation(kw, err) -> None:
    with pytest.raises(err):
        MediaItem(**kw)


def test_media_digest_is_content_addressed() -> None:
    a = MediaItem("image", tensor=torch.arange(12, dtype=torch.uint8).reshape(3, 2, 2))
    b = MediaItem("image", tensor=torch.arange(12, dtype=torch.uint8).reshape(3, 2, 2).clone())
    c = MediaItem("image", tensor=torch.arange(12, dtype=torch.uint8).reshape(3, 4, 1))
    assert a.digest == b.digest != c.digest
    assert tensor_digest(torch.zeros(2, dtype=torch.int32)) != tensor_digest(torch.zeros(2, dtype=torch.int64))
    assert MediaItem("audio", data=b"abc").digest == MediaItem("audio", data=b"abc").digest
    assert MediaItem("audio", data=b"abc").nbytes == 3 and a.nbytes == 12


def test_derived_values_and_meta_json_round_trip() -> None:
    img = MediaItem("image", tensor=torch.zeros(3, 2, 2, dtype=torch.uint8))
    t = make(token_versions=torch.tensor([3, 5]), media=[img], scalars={"reward": 1.0})
    assert t.num_tokens == 5
    assert t.version_mean == 4.0
    assert t.nbytes == 3 * 8 + 2 * 8 + 2 * 8 + 12
    m = t.meta(location="node0", seq=7)
    assert m.media_digests == (img.digest,) and m.location == "node0" and m.seq == 7
    assert TrajectoryMeta.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    with pytest.raises(ValidationError, match="bad trajectory metadata"):
        TrajectoryMeta.from_dict({"id": "x"})


def test_equals_detects_any_difference() -> None:
    t = make(scalars={"reward": 1.0}, tensors={"logp": torch.zeros(2)})
    assert t.equals(make(scalars={"reward": 1.0}, tensors={"logp": torch.zeros(2)}))
    assert not t.equals(make(scalars={"reward": 2.0}, tensors={"logp": torch.zeros(2)}))
    assert not t.equals(make(scalars={"reward": 1.0}, tensors={"logp": torch.zeros(2, dtype=torch.float64)}))
    assert not t.equals(make(scalars={"reward": 1.0}, tensors={"logp": torch.zeros(2)}, gen_version=4))


def test_metas_by_group_keeps_order() -> None:
    metas = [TrajectoryMeta(id=f"t{i}", source="s", group=f"g{i % 2}") for i in range(5)]
    groups = metas_by_group(metas)
    assert list(groups) == ["g0", "g1"]
    assert [m.id for m in groups["g0"]] == ["t0", "t2", "t4"]


def test_scalar_too_large_for_float_names_trajectory_and_field():
    with pytest.raises(ValidationError) as e:
        Trajectory(id="big", source="s", group="g", prompt_ids=torch.arange(2), response_ids=torch.arange(3),
                   scalars={"reward": 10**400})
    assert e.value.trajectory_id == "big" and e.value.field == "scalars.reward"


@pytest.mark.parametrize("where", ["tensors", "loss_mask", "media"])
def test_dtypes_that_cannot_be_stored_are_refused(where) -> None:
    c = torch.zeros(2, dtype=torch.complex64)
    kw = {
        "tensors": {"tensors": {"x": c}},
        "loss_mask": {"loss_mask": c},
        "media": {"media": [MediaItem("audio", tensor=c, sample_rate=8000)]},
    }[where]
    with pytest.raises(FieldTypeError, match="complex64") as e:
        make(**kw)
    assert e.value.trajectory_id == "t1"


def test_int_scalars_are_stored_as_float() -> None:
    from knitdata.codec import decode_trajectory, encode_trajectory

    t = make(scalars={"reward": 1, "advantage": -2.5})
    assert t.scalars == {"reward": 1.0, "advantage": -2.5}
    assert all(type(v) is float for v in t.scalars.values())
    back = decode_trajectory(encode_trajectory(t))
    assert all(type(v) is float for v in back.scalars.values()) and back.equals(t)
    assert json.loads(json.dumps(t.scalars)) == {"reward": 1.0, "advantage": -2.5}
    with pytest.raises(FieldTypeError, match="scalars.flag"):
        make(scalars={"flag": True})


@pytest.mark.parametrize(
    "value",
    [np.float32(0.25), np.float64(0.25), np.float16(0.25), np.int64(3), np.uint8(3), np.array(0.25, dtype=np.float32),
     torch.tensor(0.25), torch.tensor(0.25, dtype=torch.bfloat16), torch.tensor(3), torch.tensor(0.25, requires_grad=True)],
    ids=lambda v: f"{type(v).__name__}-{getattr(v, 'dtype', '')}",
)
def test_numpy_and_0d_tensor_scalars_are_stored_as_float(value) -> None:
    """A reward computed with numpy (``numpy.float32``) or torch (a 0-d tensor) is accepted as a float."""
    from knitdata.codec import decode_trajectory, encode_trajectory

    t = make(scalars={"reward": value, "advantage": 1})
    want = float(value.item())
    assert t.scalars == {"reward": want, "advantage": 1.0}
    assert all(type(v) is float for v in t.scalars.values())
    assert json.loads(json.dumps(t.scalars)) == t.scalars
    assert decode_trajectory(encode_trajectory(t)).equals(t)


@pytest.mark.parametrize(
    ("value", "message"),
    [(np.bool_(True), "expected a float, got a numpy bool"), (np.complex64(1), "numpy complex64"),
     (np.array([0.5, 0.5]), "got an array of shape \\(2,\\)"), (torch.tensor([0.5]), "got a tensor of shape \\(1,\\)"),
     (torch.tensor(True), "dtype torch.bool"), (np.str_("1"), "numpy str_"), ("1", "got str")],
    ids=lambda v: repr(v)[:30],
)
def test_non_real_scalars_are_refused_naming_the_field(value, message) -> None:
    with pytest.raises(FieldTypeError, match=message) as e:
        make(scalars={"reward": value})
    assert e.value.trajectory_id == "t1" and e.value.field == "scalars.reward"


@pytest.mark.parametrize("value", [np.float32(np.nan), np.float64(np.inf), torch.tensor(float("nan"))], ids=repr)
def test_non_finite_numpy_and_tensor_scalars_are_refused(value) -> None:
    with pytest.raises(ValidationError, match="must be finite") as e:
        make(scalars={"reward": value})
    assert e.value.field == "scalars.reward"


def test_meta_packs_its_counts_for_planning() -> None:
    """``packed`` holds num_tokens, nbytes, seq and hash(id) as int64 (None when they do not fit); it is derived,
    so it is not an argument, not compared and not serialized; pickling and copying build it again."""
    import copy
    import dataclasses
    import pickle

    from knitdata.record import PACKED_META, TrajectoryMeta

    m = TrajectoryMeta(id="t", source="s", group="g", num_tokens=5, nbytes=1 << 40, seq=-1, location="u")
    assert PACKED_META.unpack(m.packed) == (5, 1 << 40, -1, hash("t"))
    assert dataclasses.replace(m, seq=9).packed == PACKED_META.pack(5, 1 << 40, 9, hash("t"))
    for twin in (pickle.loads(pickle.dumps(m)), copy.copy(m), copy.deepcopy(m)):
        assert twin == m and twin.packed == m.packed and twin.location == "u"
    assert "packed" not in m.to_dict() and TrajectoryMeta.from_dict(m.to_dict()) == m
    assert TrajectoryMeta(id="t", source="s", group="g", num_tokens=7.5).packed is None
    assert TrajectoryMeta(id="t", source="s", group="g", seq=1 << 64).packed is None
    with pytest.raises(TypeError):
        TrajectoryMeta(id="t", source="s", group="g", packed=b"")  # type: ignore[call-arg]


def test_media_reference_form():
    from knitdata.errors import FieldTypeError as FTE
    from knitdata.record import media_digest

    img = MediaItem("image", tensor=torch.zeros(3, 2, 2, dtype=torch.uint8))
    ref = MediaItem.ref("image", media_digest(img))
    assert ref.is_reference and ref.reference and ref.nbytes == 0 and ref.tensor is None and ref.data is None
    assert MediaItem("image", digest=img.digest, reference=True) == ref
    assert MediaItem.ref("audio", "d" * 32, sample_rate=16000).sample_rate == 16000
    with pytest.raises(ValidationError, match="digest"):
        MediaItem.ref("image", "")
    with pytest.raises(ValidationError, match="neither"):
        MediaItem("image", tensor=img.tensor, digest=img.digest, reference=True)
    with pytest.raises(ValidationError, match="sample_rate"):
        MediaItem.ref("audio", "d" * 32, sample_rate=0)
    with pytest.raises(FTE):
        MediaItem("image", digest="d", reference=1)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="exactly one"):
        MediaItem("image")  # not a reference: content needed, as before
    t = Trajectory(id="x", source="s", group="g", prompt_ids=torch.arange(2), response_ids=torch.arange(2),
                   media=[img, ref])
    assert t.nbytes == 32 + img.nbytes and t.meta().media_digests == (img.digest, img.digest)
