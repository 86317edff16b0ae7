"""Tests of knitdata.consumer.collate: pad/pack layouts, round trips, dtypes, empty batches, device movement."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from knitdata.consumer.collate import MicroBatch, MicroBatchInfo, TokenCollator
from knitdata.errors import ConfigError, FieldTypeError, ValidationError
from knitdata.record import Trajectory

PAD = -7


@st.composite
def trajectory_lists(draw: st.DrawFn, max_size: int = 6) -> list[Trajectory]:
    n = draw(st.integers(1, max_size))
    mask_kind = draw(st.sampled_from(["none", "bool", "float"]))
    with_scalars = draw(st.booleans())
    with_extras = draw(st.booleans())
    with_versions = draw(st.booleans())
    out = []
    for i in range(n):
        p = draw(st.integers(0, 6))
        r = draw(st.integers(1, 9))
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
        mask = None
        if mask_kind == "bool":
            mask = torch.rand(r, generator=g) > 0.3
        elif mask_kind == "float":
            mask = torch.rand(r, generator=g)
        version = draw(st.integers(0, 5))
        out.append(
            Trajectory(
                id=f"t{i}",
                source="s",
                group=f"g{i // 2}",
                prompt_ids=torch.randint(0, 1000, (p,), generator=g, dtype=torch.int32),
                response_ids=torch.randint(0, 1000, (r,), generator=g),
                gen_version=version,
                loss_mask=mask,
                token_versions=(torch.full((r,), version) + (torch.arange(r) > 0)) if with_versions else None,
                scalars={"reward": float(i) - 0.5, "adv": 2.0 * i} if with_scalars else {},
                tensors={"logp": -torch.rand(r, generator=g), "emb": torch.randn(2, 2, generator=g)} if with_extras else {},
            )
        )
    return out


def unbatch(mb: MicroBatch) -> list[dict[str, torch.Tensor]]:
    """Recover every sequence's prompt, response, response loss mask and aligned extras from a batch."""
    assert mb.prompt_lengths is not None and mb.response_lengths is not None
    out = []
    for i in range(mb.num_sequences):
        p, r = int(mb.prompt_lengths[i]), int(mb.response_lengths[i])
        if mb.cu_seqlens is not None:
            row, lo = 0, int(mb.cu_seqlens[i])
            assert int(mb.cu_seqlens[i + 1]) - lo == p + r
        else:
            row, lo = i, 0
        seq = {name: t[row, lo : lo + p + r] for name, t in
               [("input_ids", mb.input_ids), ("loss_mask", mb.loss_mask), ("position_ids", mb.position_ids),
                *((k, v) for k, v in mb.tensors.items() if v.dim() == 2 and v.shape == mb.input_ids.shape)]}
        out.append({"p": p, "r": r, **seq})
    return out


@settings(max_examples=40, deadline=None)
@given(trajs=trajectory_lists(), mode=st.sampled_from(["pad", "pack"]), mult=st.sampled_from([None, 1, 4, 8]))
def test_round_trip(trajs: list[Trajectory], mode: str, mult: int | None) -> None:
    mb = TokenCollator(pad_id=PAD, mode=mode, pad_to_multiple_of=mult)(trajs)
    b = len(trajs)
    lens = [t.num_tokens for t in trajs]
    # layout and dtypes
    assert mb.input_ids.dtype == torch.int64 and mb.position_ids.dtype == torch.int64
    assert mb.loss_mask.dtype == torch.float32
    assert mb.loss_mask.shape == mb.input_ids.shape == mb.position_ids.shape
    if mode == "pad":
        assert mb.input_ids.shape[0] == b and mb.cu_seqlens is None
        assert mb.attention_mask is not None and mb.attention_mask.shape == mb.input_ids.shape
        assert mb.attention_mask.sum(1).tolist() == lens
        width = max(lens)
    else:
        assert mb.input_ids.shape[0] == 1 and mb.attention_mask is None
        assert mb.cu_seqlens is not None and mb.cu_seqlens.dtype == torch.int32 and mb.cu_seqlens.shape == (b + 1,)
        assert int(mb.cu_seqlens[-1]) == sum(lens)
        width = sum(lens)
    m = mult or 1
    assert mb.input_ids.shape[1] == -(-width // m) * m
    assert mb.num_sequences == b and mb.num_tokens == sum(lens) and not mb.is_empty
    # padding: pad id, zero loss mask; total loss mass is the responses' only
    assert int((mb.input_ids == PAD).sum()) == mb.input_ids.numel() - sum(lens)
    expected_mass = sum(float(t.loss_mask.float().sum()) if t.loss_mask is not None else t.response_ids.numel()
                        for t in trajs)
    assert float(mb.loss_mask.sum()) == pytest.approx(expected_mass, rel=1e-5)
    # per-sequence round trip
    for t, seq in zip(trajs, unbatch(mb)):
        p, r = seq["p"], seq["r"]
        assert torch.equal(seq["input_ids"][:p], t.prompt_ids.long())
        assert torch.equal(seq["input_ids"][p:], t.response_ids.long())
        assert torch.equal(seq["position_ids"], torch.arange(p + r))
        assert not seq["loss_mask"][:p].any()
        want = torch.ones(r) if t.loss_mask is None else t.loss_mask.float()
        assert torch.equal(seq["loss_mask"][p:], want)
        if t.tensors:
            assert torch.equal(seq["logp"][p:], t.tensors["logp"]) and not seq["logp"][:p].any()
        if t.token_versions is not None:
            assert torch.equal(seq["token_versions"][p:], t.token_versions.long())
            assert bool((seq["token_versions"][:p] == -1).all())
    # scalars and stacked extras
    if trajs[0].scalars:
        assert set(mb.scalars) == {"reward", "adv"}
        for name, v in mb.scalars.items():
            assert v.dtype == torch.float32 and v.tolist() == [t.scalars[name] for t in trajs]
    if trajs[0].tensors:
        assert mb.tensors["emb"].shape == (b, 2, 2)
        assert torch.equal(mb.tensors["emb"], torch.stack([t.tensors["emb"] for t in trajs]))
    assert mb.nbytes == sum(x.numel() * x.element_size() for x in mb.iter_tensors())


@pytest.mark.parametrize("mode", ["pad", "pack"])
def test_empty_microbatch(mode: str) -> None:
    info = MicroBatchInfo(consumer=1, train_batch=0, minibatch=3, minibatch_in_batch=3, microbatch=1,
                          num_microbatches=2, is_last=True, global_tokens=100, global_trajectories=4)
    mb = TokenCollator(mode=mode)([], info)
    assert mb.is_empty and mb.num_sequences == 0 and mb.num_tokens == 0 and mb.info is info and info.is_empty
    assert mb.input_ids.shape == (0, 0) and mb.loss_mask.shape == (0, 0) and mb.position_ids.shape == (0, 0)
    assert mb.loss_mask.dtype == torch.float32 and mb.input_ids.dtype == torch.int64
    assert mb.num_loss_tokens == 0.0 and mb.scalars == {} and mb.tensors == {}
    if mode == "pack":
        assert mb.attention_mask is None and mb.cu_seqlens is not None and mb.cu_seqlens.tolist() == [0]
    else:
        assert mb.attention_mask is not None and mb.attention_mask.shape == (0, 0) and mb.cu_seqlens is None
    moved = mb.to("cpu")
    assert moved.is_empty and moved.info is info


def _traj(i: int, **kw: object) -> Trajectory:
    base: dict = dict(id=f"t{i}", source="s", group="g", prompt_ids=torch.arange(2), response_ids=torch.arange(3))
    base.update(kw)
    return Trajectory(**base)


def test_missing_scalar_names_trajectory_and_field() -> None:
    trajs = [_traj(0, scalars={"reward": 1.0}), _traj(1, scalars={})]
    with pytest.raises(ValidationError) as ei:
        TokenCollator()(trajs)
    assert ei.value.trajectory_id == "t1" and ei.value.field == "scalars.reward"
    assert "'t1'" in str(ei.value) and "scalars.reward" in str(ei.value)
    # the first trajectory may be the one missing it
    with pytest.raises(ValidationError) as ei:
        TokenCollator()(trajs[::-1])
    assert ei.value.trajectory_id == "t1"


def test_extra_tensors_missing_or_ragged() -> None:
    with pytest.raises(ValidationError) as ei:
        TokenCollator()([_traj(0, tensors={"x": torch.ones(2)}), _traj(1)])
    assert ei.value.trajectory_id == "t1" and ei.value.field == "tensors.x"
    with pytest.raises(ValidationError) as ei:
        TokenCollator()([_traj(0, tensors={"x": torch.ones(2)}), _traj(1, tensors={"x": torch.ones(4)})])
    assert ei.value.trajectory_id == "t1" and "shape" in str(ei.value)
    # dtype promotion across trajectories when stacking
    mb = TokenCollator()([_traj(0, tensors={"x": torch.ones(2, dtype=torch.int32)}),
                          _traj(1, tensors={"x": torch.ones(2, dtype=torch.float32)})])
    assert mb.tensors["x"].dtype == torch.float32 and mb.tensors["x"].shape == (2, 2)


def test_bad_inputs() -> None:
    with pytest.raises(ConfigError):
        TokenCollator(mode="ragged")
    with pytest.raises(ConfigError):
        TokenCollator(pad_to_multiple_of=0)
    with pytest.raises(FieldTypeError):
        TokenCollator()([{"id": "x"}])  # type: ignore[list-item]
    info = MicroBatchInfo(0, 0, 0, 0, 0, 1, True, 5, 1, 0, ("other",), (0,))
    with pytest.raises(ValidationError):
        TokenCollator()([_traj(0)], info)


def test_info_json_round_trip_and_validation() -> None:
    info = MicroBatchInfo(consumer=2, train_batch=1, minibatch=5, minibatch_in_batch=1, microbatch=0,
                          num_microbatches=3, is_last=False, global_tokens=1234, global_trajectories=16,
                          global_loss_tokens=900, trajectory_ids=["a", "b"], gen_versions=[3, 4])  # type: ignore[arg-type]
    assert info.trajectory_ids == ("a", "b")  # lists normalized to tuples
    back = MicroBatchInfo.from_dict(json.loads(json.dumps(info.to_dict())))
    assert back == info and hash(back) == hash(info)
    with pytest.raises(ValidationError):
        MicroBatchInfo(0, 0, 0, 0, 1, 3, True, 0, 0)  # is_last contradicts microbatch
    with pytest.raises(ValidationError):
        MicroBatchInfo(0, 0, 0, 0, 3, 3, True, 0, 0)  # microbatch out of range
    with pytest.raises(ValidationError):
        MicroBatchInfo(0, 0, 0, 0, 0, 1, True, 0, 0, 0, ("a",), ())
    with pytest.raises(ValidationError):
        MicroBatchInfo.from_dict({"consumer": 0})


class FakeMedia:
    """Duck-typed media batch recording how it was moved."""

    def __init__(self, t: torch.Tensor, calls: list | None = None):
        self.t = t
        self.calls = calls if calls is not None else []

    def pin_memory(self) -> FakeMedia:
        self.calls.append("pin")
        return FakeMedia(self.t.pin_memory(), self.calls)

    def to(self, device: object, non_blocking: bool = False) -> FakeMedia:
        self.calls.append(("to", str(device), non_blocking))
        return FakeMedia(self.t.to(device, non_blocking=non_blocking), self.calls)


def test_pin_and_to_on_cpu_and_send_to_device() -> None:
    accelerate_utils = pytest.importorskip("accelerate.utils")
    info = MicroBatchInfo(0, 0, 0, 0, 0, 1, True, 10, 2, 6, ("t0", "t1"), (0, 0))
    mb = TokenCollator(mode="pack")([_traj(0, scalars={"r": 1.0}), _traj(1, scalars={"r": 2.0})], info)
    mb.media = FakeMedia(torch.ones(4))
    if not torch.cuda.is_available():
        assert mb.pin_memory() is mb  # documented: no CUDA, nothing to pin, no failure
    moved = mb.to("cpu", non_blocking=True)
    assert moved is not mb and moved.info is info and isinstance(moved, MicroBatch)
    assert torch.equal(moved.input_ids, mb.input_ids) and torch.equal(moved.cu_seqlens, mb.cu_seqlens)
    assert mb.media.calls == [("to", "cpu", True)]
    # accelerate treats anything with .to(device, non_blocking=...) as a leaf and calls it
    sent = accelerate_utils.send_to_device({"mb": mb, "x": torch.zeros(1)}, "cpu", non_blocking=True)
    assert isinstance(sent["mb"], MicroBatch) and sent["mb"].info is info
    assert torch.equal(sent["mb"].scalars["r"], torch.tensor([1.0, 2.0]))
    assert mb.media.calls[-1] == ("to", "cpu", True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pin_and_to_cuda() -> None:
    mb = TokenCollator()([_traj(0, tensors={"x": torch.ones(3)}), _traj(1, tensors={"x": torch.ones(3)})])
    mb.media = FakeMedia(torch.arange(5.0))
    pinned = mb.pin_memory()
    assert all(t.is_pinned() for t in pinned.iter_tensors()) and pinned.media.t.is_pinned()
    dev = pinned.to("cuda", non_blocking=True)
    torch.cuda.current_stream().synchronize()
    assert all(t.is_cuda for t in dev.iter_tensors()) and dev.media.t.is_cuda
    assert torch.equal(dev.input_ids.cpu(), mb.input_ids) and torch.equal(dev.tensors["x"].cpu(), mb.tensors["x"])
    back = dev.to(torch.device("cpu"))
    assert torch.equal(back.loss_mask, mb.loss_mask)


# ---------------------------------------------------------------------------------------------- equality
def test_microbatch_equality_is_documented_and_exact() -> None:
    trajs = [_traj(i) for i in range(3)]
    for mode in ("pad", "pack"):
        a, b = TokenCollator(mode=mode)(trajs), TokenCollator(mode=mode)(trajs)
        assert a == b and a.equals(b)
        assert [a, b] == [b, a]  # lists of micro-batches compare without "ambiguous truth value" errors
        assert a != 1 and not a.equals("x")
        c = TokenCollator(mode=mode)(trajs[:2])
        assert a != c
        d = TokenCollator(mode=mode)(trajs)
        d.loss_mask = d.loss_mask.clone()
        d.loss_mask.view(-1)[-1] += 1e-6
        assert a != d and not a.equals(d)
        assert a.equals(d, atol=1e-5)
        e = TokenCollator(mode=mode)(trajs)
        e.input_ids = e.input_ids.to(torch.int32)  # same values, another dtype
        assert not a.equals(e)
        with pytest.raises(TypeError):
            hash(a)


def test_microbatch_equality_covers_info_and_media() -> None:
    from knitdata.media.multimodal import MultimodalCollator
    from knitdata.media.process import image_item, patchify

    img = image_item(torch.randint(0, 255, (3, 28, 28), dtype=torch.uint8))
    trajs = [_traj(i) for i in range(2)]
    for t in trajs:
        t.media = [img]
    info = MicroBatchInfo(consumer=0, train_batch=0, minibatch=0, minibatch_in_batch=0, microbatch=0,
                          num_microbatches=1, is_last=True, global_tokens=10, global_trajectories=2)
    mm = MultimodalCollator({"image": patchify(14)})
    a = TokenCollator()(trajs)
    b = TokenCollator()(trajs)
    a.media, b.media = mm([trajs]), mm([trajs])
    assert a == b
    b.media.tables["image"].values.view(-1)[0] += 1
    assert a != b
    b.media = a.media
    a.info, b.info = info, info
    assert a == b
    b.info = MicroBatchInfo(**{**info.to_dict(), "global_tokens": 11})
    assert a != b


def test_a_tensor_that_breaks_response_alignment_is_named_not_an_aligned_one() -> None:
    # old_logprobs one longer than t3's response: t0 and t2 follow their responses, t3 does not (the error
    # named t2 before, whose tensor is right)
    def traj(tid: str, rlen: int, lp_len: int) -> Trajectory:
        return Trajectory(id=tid, source="math", group="g", prompt_ids=torch.arange(2), response_ids=torch.arange(rlen),
                          tensors={"old_logprobs": torch.zeros(lp_len)})

    with pytest.raises(ValidationError, match="not 1-D of its response length") as e:
        TokenCollator()([traj("t0", 3, 3), traj("t2", 4, 4), traj("t3", 2, 3)])
    assert e.value.trajectory_id == "t3" and e.value.field == "tensors.old_logprobs"
    assert "(2)" in str(e.value) and "'t0'" in str(e.value)


def test_a_declared_layout_does_not_depend_on_the_response_lengths() -> None:
    """A fixed-size per-trajectory vector (4) was aligned [B, T] when every response of the micro-batch had 4
    tokens and stacked [B, 4] otherwise (new-user audit): declared ``"stack"`` it is [B, 4] in both; declared
    ``"token"``, a misfit is refused naming the trajectory and field."""
    def t(i: int, rlen: int, emb: torch.Tensor | None = None) -> Trajectory:
        return Trajectory(id=f"t{i}", source="s", group="g", prompt_ids=torch.arange(2), response_ids=torch.arange(rlen),
                          tensors={"emb": torch.arange(4.0) if emb is None else emb})

    undeclared = TokenCollator()
    assert tuple(undeclared([t(0, 4), t(1, 4)]).tensors["emb"].shape) == (2, 6)  # the data-dependent rule
    assert tuple(undeclared([t(0, 4), t(1, 5)]).tensors["emb"].shape) == (2, 4)
    stack = TokenCollator(tensor_layouts={"emb": "stack"})
    for lens in ([4, 4], [4, 5], [3, 4]):
        out = stack([t(i, n) for i, n in enumerate(lens)]).tensors["emb"]
        assert tuple(out.shape) == (2, 4) and torch.equal(out[1], torch.arange(4.0))
    token = TokenCollator(tensor_layouts={"emb": "token"})
    assert tuple(token([t(0, 4), t(1, 4)]).tensors["emb"].shape) == (2, 6)
    with pytest.raises(ValidationError, match=r"declared layout 'token'") as e:
        token([t(0, 4), t(1, 5)])
    assert (e.value.trajectory_id, e.value.field) == ("t1", "tensors.emb")
    with pytest.raises(ValidationError, match=r"declared layout 'stack'") as e:
        stack([t(0, 4), t(1, 4, torch.zeros(3))])
    assert (e.value.trajectory_id, e.value.field) == ("t1", "tensors.emb")
    with pytest.raises(ConfigError, match="tensor_layouts"):
        TokenCollator(tensor_layouts={"emb": "rows"})
    assert "tensor_layouts={'emb': 'stack'}" in repr(stack)
