"""SharedEncoding: gradients equal the naive duplicated path in every mode, plus the guards around it."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from _multimodal_helpers import (  # noqa: E402
    D_IN,
    D,
    TinyBackbone,
    TinyEncoder,
    assert_grads_close,
    collate,
    grads,
    make_layout,
    run_naive,
    run_shared,
    zero,
)

from knitdata.errors import ConfigError, StateError  # noqa: E402
from knitdata.media.encoder import MODES, SharedEncoding, SharedMiniBatch, check_independence, grad_sync  # noqa: E402
from knitdata.media.multimodal import MediaTable, MultimodalCollator  # noqa: E402
from knitdata.record import MediaItem, Trajectory  # noqa: E402


def _compare(seed, groups, group_size, max_items, max_len, k, output, mode, key, ckpt_enc, ckpt_bb, dtype):
    torch.manual_seed(seed)
    rng = random.Random(seed)
    mbs = make_layout(rng, groups=groups, group_size=group_size, max_items=max_items, max_len=max_len, k=k, dtype=dtype)
    batch = collate(mbs, key)
    enc = TinyEncoder(output=output, ckpt=ckpt_enc, dtype=dtype)
    bb = TinyBackbone(ckpt=ckpt_bb, dtype=dtype)
    scales = [rng.choice([1.0, 0.5, 1 / 3, 2.0, rng.uniform(0.01, 3.0)]) for _ in mbs]
    run_naive(enc, bb, batch, mbs, scales, output)
    ref = grads(enc, bb)
    zero(enc, bb)
    run_shared(SharedEncoding(enc, mode=mode, chunk_items=rng.choice([None, 1, 2])), bb, batch, mbs, scales, output)
    got = grads(enc, bb)
    assert_grads_close(got, ref, dtype)
    return batch, ref


layouts = dict(
    seed=st.integers(0, 10_000),
    groups=st.integers(1, 4),
    group_size=st.integers(1, 4),
    max_items=st.integers(0, 2),
    max_len=st.integers(1, 5),
    k=st.integers(1, 4),
    output=st.sampled_from(["rows", "pooled", "tree"]),
    mode=st.sampled_from(MODES),
    key=st.sampled_from(["digest", "provenance"]),
    ckpt_enc=st.booleans(),
    ckpt_bb=st.booleans(),
)


@settings(max_examples=40, deadline=None)
@given(**layouts)
def test_gradients_equal_naive_float64(**kw):
    _compare(dtype=torch.float64, **kw)


@settings(max_examples=15, deadline=None)
@given(**layouts)
def test_gradients_equal_naive_float32(**kw):
    _compare(dtype=torch.float32, **kw)


@pytest.mark.parametrize("mode", MODES)
def test_duplicates_spanning_microbatches_and_empty_ones(mode):
    """A fixed layout with every hard case at once; also shows encoder work really is deduplicated."""
    batch, ref = _compare(3, 3, 4, 2, 5, 4, "rows", mode, "provenance", True, False, torch.float64)
    assert batch.num_occurrences > batch.num_unique > 0
    assert any(v.abs().max() > 0 for k, v in ref.items() if k.startswith("0."))


def test_minibatch_without_media_all_modes():
    rng = random.Random(1)
    mbs = make_layout(rng, groups=2, group_size=2, max_items=0, max_len=2, k=2)
    batch = collate(mbs)
    assert batch.is_empty and batch.tables == {}
    for mode in MODES:
        enc, bb = TinyEncoder(), TinyBackbone()
        run_shared(SharedEncoding(enc, mode=mode), bb, batch, mbs, [1.0, 0.5], "rows")
        assert all(p.grad is None for p in enc.parameters())
        assert all(p.grad is not None for p in bb.emb.parameters())


def test_dummy_encode_gives_zero_encoder_gradients():
    rng = random.Random(1)
    mbs = make_layout(rng, groups=2, group_size=2, max_items=0, max_len=2, k=3)
    batch = collate(mbs)
    dummy = MediaTable.empty_like("image", (D_IN,), torch.float64, length=2)
    for mode in MODES:
        enc, bb = TinyEncoder(), TinyBackbone()
        run_shared(SharedEncoding(enc, mode=mode, dummy=True, dummy_input=dummy), bb, batch, mbs, [1.0] * 3, "rows")
        for p in enc.parameters():
            assert p.grad is not None and float(p.grad.abs().max()) == 0.0
    with pytest.raises(ConfigError, match="dummy_input"):
        run_shared(SharedEncoding(TinyEncoder(), dummy=True), TinyBackbone(), batch, mbs, [1.0] * 3, "rows")


# ---------------------------------------------------------------------------------------------- negative controls
def _wrong_overwrite(self, st_, items, rows):  # index_copy_: duplicates overwrite instead of adding up
    idx = st_.layout.row_index(items)[0]
    if rows.grad is not None:
        st_.grads[0].index_copy_(0, idx, rows.grad.to(st_.grads[0].dtype))


def _wrong_forget_first(self, st_, items, rows):  # drops micro-batch 0's contribution
    if self._i > 0:
        _RIGHT_ACCUMULATE(self, st_, items, rows)


_RIGHT_ACCUMULATE = SharedMiniBatch._accumulate


@pytest.mark.parametrize("wrong", [_wrong_overwrite, _wrong_forget_first])
@pytest.mark.parametrize("mode", ["fold", "leaf", "recompute"])
def test_negative_controls_catch_wrong_accumulation(monkeypatch, wrong, mode):
    _compare(7, 3, 4, 2, 5, 4, "rows", mode, "provenance", False, False, torch.float64)  # right: passes
    monkeypatch.setattr(SharedMiniBatch, "_accumulate", wrong)
    with pytest.raises(AssertionError):
        _compare(7, 3, 4, 2, 5, 4, "rows", mode, "provenance", False, False, torch.float64)


def test_negative_control_unscaled_naive_differs():
    """The comparison is sensitive to loss scaling: the naive path with other scales gives other gradients."""
    rng = random.Random(3)
    mbs = make_layout(rng, groups=3, group_size=4, max_items=2, max_len=5, k=4)
    batch = collate(mbs)
    enc, bb = TinyEncoder(), TinyBackbone()
    run_naive(enc, bb, batch, mbs, [1.0, 1.0, 1.0, 1.0], "rows")
    ref = grads(enc, bb)
    zero(enc, bb)
    run_shared(SharedEncoding(enc), bb, batch, mbs, [1.0, 0.5, 1.0, 1.0], "rows")
    with pytest.raises(AssertionError):
        assert_grads_close(grads(enc, bb), ref, torch.float64)


# ---------------------------------------------------------------------------------------------- buffers and guards
def test_gradient_buffers_are_fp32_for_low_precision_outputs():
    rng = random.Random(0)
    mbs = make_layout(rng, groups=2, group_size=2, max_items=1, max_len=3, k=2, dtype=torch.bfloat16)
    mbs[0][0].media.append(MediaItem(kind="image", tensor=torch.randn(2, D_IN, dtype=torch.bfloat16)))
    batch = collate(mbs)
    enc = TinyEncoder(dtype=torch.bfloat16)
    with SharedEncoding(enc).minibatch(batch) as shared:
        buf = shared._state["image"].grads[0]
        assert buf.dtype == torch.float32
        for i in range(len(mbs)):
            r = shared.rows(i)
            shared.backward(r.float().pow(2).sum() if r is not None else torch.zeros((), requires_grad=True))
    assert all(p.grad is not None for p in enc.parameters())


def _simple_batch():
    rng = random.Random(5)
    mbs = make_layout(rng, groups=2, group_size=2, max_items=1, max_len=3, k=2)
    mbs[0].append(
        Trajectory(id="extra", source="v", group="x", prompt_ids=torch.tensor([1]), response_ids=torch.tensor([2]),
                   media=[MediaItem(kind="image", tensor=torch.randn(2, D_IN, dtype=torch.float64))])
    )
    mbs[1].append(
        Trajectory(id="extra2", source="v", group="x", prompt_ids=torch.tensor([1]), response_ids=torch.tensor([2]),
                   media=[MediaItem(kind="image", tensor=torch.randn(3, D_IN, dtype=torch.float64))])
    )
    return mbs, collate(mbs)


def test_stale_encoding_after_optimizer_step_is_refused():
    mbs, batch = _simple_batch()
    enc = TinyEncoder()
    opt = torch.optim.SGD(enc.parameters(), lr=0.1)
    with pytest.raises(StateError, match="optimizer step"):
        with SharedEncoding(enc, mode="leaf").minibatch(batch) as shared:
            shared.backward(shared.rows(0).sum())
            for p in enc.parameters():
                p.grad = torch.ones_like(p)
            opt.step()
            shared.rows(1)


def test_order_close_and_reuse_guards():
    mbs, batch = _simple_batch()
    enc = TinyEncoder()
    se = SharedEncoding(enc)
    with pytest.raises(StateError, match="in order"):
        with se.minibatch(batch) as shared:
            shared.rows(1)
    with pytest.raises(StateError, match="closed after 1 of 2"):
        with se.minibatch(batch) as shared:
            shared.backward(shared.rows(0).sum())
    with se.minibatch(batch) as shared:
        for i in range(2):
            shared.backward(shared.rows(i).sum())
        with pytest.raises(StateError, match="already"):
            shared.backward(torch.zeros((), requires_grad=True))
    with pytest.raises(StateError, match="closed"):
        shared.rows(0)
    with se.minibatch(batch):
        with pytest.raises(StateError, match="already open"):
            with se.minibatch(batch):
                pass
    with se.minibatch(batch):  # forward-only use (evaluation) is fine
        pass


def test_batchnorm_and_dropout_detection():
    mbs, batch = _simple_batch()

    class BNEnc(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D_IN, D, dtype=torch.float64)
            self.bn = nn.BatchNorm1d(D, dtype=torch.float64)
            self.drop = nn.Dropout(0.1)

        def forward(self, values, offsets):
            return self.drop(self.bn(self.lin(values)))

    enc = BNEnc()
    with pytest.raises(ConfigError, match="BatchNorm"):
        with SharedEncoding(enc).minibatch(batch):
            pass
    with pytest.warns(UserWarning, match="BatchNorm"):
        with SharedEncoding(enc, strict=False).minibatch(batch):
            pass
    enc.bn.eval()
    with SharedEncoding(enc).minibatch(batch):  # dropout is fine in fold
        pass
    with pytest.raises(ConfigError, match="dropout"):
        with SharedEncoding(enc, mode="recompute").minibatch(batch):
            pass


def test_check_independence():
    table = collate(_simple_batch()[0]).tables["image"]
    assert check_independence(TinyEncoder(), table) < 1e-12

    class CrossItem(nn.Module):  # attends across items: not independent
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D_IN, D, dtype=torch.float64)

        def forward(self, values, offsets):
            h = self.lin(values)
            return h + (h @ h.T).softmax(-1) @ h

    with pytest.raises(ConfigError, match="interact"):
        check_independence(CrossItem(), table)


def test_several_kinds_and_out_lengths():
    """An image and an audio encoder in one SharedEncoding; the audio encoder emits 2 rows per item."""
    torch.manual_seed(0)
    img = [MediaItem(kind="image", tensor=torch.randn(n, D_IN, dtype=torch.float64)) for n in (2, 3)]
    aud = [MediaItem(kind="audio", tensor=torch.randn(n * 4), sample_rate=8000) for n in (3, 5)]
    mk = lambda i, g, media: Trajectory(id=f"t{i}", source="v", group=g, prompt_ids=torch.tensor([1, 2]),  # noqa: E731
                                        response_ids=torch.tensor([i % 50]), media=media)
    mbs = [[mk(0, "a", [img[0], aud[0]]), mk(1, "a", [img[0], aud[0]])], [mk(2, "b", [aud[1]])],
           [mk(3, "a", [img[0], aud[0]]), mk(4, "c", [img[1]])]]
    coll = MultimodalCollator({"audio": lambda x, sr: x.reshape(-1, 4).double()}, key="provenance")
    batch = coll(mbs)
    assert batch.kinds == ("audio", "image") and batch.tables["audio"].num_items == 2

    class AudioEnc(nn.Module):  # first and mean frame per item: 2 output rows per item
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, D, dtype=torch.float64)

        def forward(self, values, offsets):
            h = torch.tanh(self.lin(values))
            first = h[offsets[:-1]]
            seg = torch.repeat_interleave(torch.arange(offsets.numel() - 1), offsets[1:] - offsets[:-1])
            mean = torch.zeros_like(first).index_add(0, seg, h) / (offsets[1:] - offsets[:-1])[:, None]
            return torch.stack([first, mean], 1).reshape(-1, D)

    ienc, aenc, head = TinyEncoder(), AudioEnc(), nn.Linear(D, 1, dtype=torch.float64)
    scales = [1.0, 0.25, 2.0]

    def loss_of(i, irows, arows):
        out = head(torch.zeros(1, D, dtype=torch.float64)).sum()
        for r in (irows, arows):
            if r is not None:
                out = out + (torch.sin(head(r)) ** 2).sum()
        return out * scales[i]

    for i in range(3):  # naive reference
        occ = batch.for_microbatch(i)
        enc_rows = []
        for kind, enc in (("image", ienc), ("audio", aenc)):
            o = occ.get(kind)
            enc_rows.append(None if o is None else enc(*(lambda t: (t.values, t.offsets))(batch.tables[kind].gather(o.index))))
        loss_of(i, *enc_rows).backward()
    ref = grads(ienc, aenc, head)
    zero(ienc, aenc, head)
    for mode in MODES:
        se = SharedEncoding({"image": ienc, "audio": aenc}, mode=mode, out_lengths=lambda lengths: torch.full_like(lengths, 2))
        with se.minibatch(batch) as shared:
            for i in range(3):
                shared.backward(loss_of(i, shared.rows(i, "image"), shared.rows(i, "audio")))
        assert_grads_close(grads(ienc, aenc, head), ref, torch.float64)
        zero(ienc, aenc, head)


def test_grad_sync_plain_module_is_noop():
    m = nn.Linear(2, 2)
    with grad_sync(m, enabled=False):
        m(torch.ones(1, 2)).sum().backward()
    assert m.weight.grad is not None


def test_bench_encode_quick(tmp_path):
    """`knitdata bench encode --quick`: report shape and exact FLOP ratios (timings are not asserted)."""
    import json

    from knitdata.cli import main

    out = tmp_path / "encode.json"
    assert main(["bench", "encode", "--quick", "--no-rss", "--repeats", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {(r["group_size"], r["mode"]): r for r in report["results"]}
    assert set(rows) == {(n, m) for n in (1, 4) for m in ("fold", "leaf", "recompute")}
    for (n, mode), r in rows.items():
        for key in ("dup_step_s", "dedup_step_s", "speedup", "encoder_share", "amdahl_bound"):
            assert isinstance(r[key], float) and r[key] > 0 or key == "encoder_share"
        f = r["encoder_share"]
        assert r["amdahl_bound"] == pytest.approx(1 / ((1 - f) + f / n))
        if mode in ("fold", "leaf"):
            assert r["encoder_flop_ratio"] == pytest.approx(n, rel=1e-9)
        else:  # forward twice, backward once over unique items: 3n / 4
            assert r["encoder_flop_ratio"] == pytest.approx(3 * n / 4, rel=0.02)


@pytest.mark.parametrize("mode", MODES)
def test_frozen_encoder_backbone_gradients_still_equal(mode):
    """A frozen encoder (no parameter requires grad): rows carry no gradient, backbone gradients unchanged."""
    rng = random.Random(7)
    mbs = make_layout(rng, groups=3, group_size=3, max_items=2, max_len=4, k=3)
    batch = collate(mbs)
    enc, bb = TinyEncoder().requires_grad_(False), TinyBackbone()
    run_naive(enc, bb, batch, mbs, [1.0, 0.5, 2.0], "rows")
    ref = grads(bb)
    zero(bb)
    run_shared(SharedEncoding(enc, mode=mode), bb, batch, mbs, [1.0, 0.5, 2.0], "rows")
    assert_grads_close(grads(bb), ref, torch.float64)


class _DtypeProbe(nn.Module):
    """A per-row encoder that records the dtype its linear layer computes in, call by call."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D_IN, D)
        self.seen: list[torch.dtype] = []

    def forward(self, values, offsets):
        h = self.lin(values)
        self.seen.append(h.dtype)
        return torch.tanh(h)


@pytest.mark.parametrize("mode", ["recompute", "fold"])
def test_recompute_reencodes_under_the_autocast_state_of_the_forward(mode):
    torch.manual_seed(0)
    table_vals = torch.randn(7, D_IN)
    table = MediaTable("image", table_vals, torch.tensor([0, 3, 7]), ("a", "b"))
    from knitdata.media.multimodal import MediaOccurrences, MultimodalBatch

    occ = [
        {"image": MediaOccurrences(torch.tensor([0, 1, 0]), torch.tensor([0, 1, 2]), torch.tensor([0, 0, 0]))},
        {"image": MediaOccurrences(torch.tensor([1]), torch.tensor([0]), torch.tensor([0]))},
    ]
    batch = MultimodalBatch({"image": table}, occ)
    head = torch.randn(D)

    def loss_of(rows):
        return (rows.float() @ head).square().sum() / 10

    # reference: the naive path, every copy encoded inside autocast, backward outside
    ref_enc = _DtypeProbe()
    enc = _DtypeProbe()
    enc.load_state_dict(ref_enc.state_dict())
    for i in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_of(ref_enc(table.gather(occ[i]["image"].index).values, None))
        loss.backward()
    shared = SharedEncoding(enc, mode=mode)
    sm = shared.minibatch(batch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sm.__enter__()  # the unique items are encoded here, inside autocast
    for i in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_of(sm.rows(i))
        sm.backward(loss)  # outside autocast: recompute re-encodes here
    sm.__exit__(None, None, None)
    assert not torch.is_autocast_enabled("cpu")
    assert enc.seen and all(d == torch.bfloat16 for d in enc.seen), enc.seen
    assert len(enc.seen) == (2 if mode == "recompute" else 1)
    for (name, p), q in zip(enc.named_parameters(), ref_enc.parameters()):
        # bf16 rounding differs between the batched unique encode and per-copy encodes: bf16 tolerance
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=2e-2, msg=name)


def test_out_rows_sees_the_table_metadata_and_excludes_out_lengths():
    with pytest.raises(ValueError, match="at most one"):
        SharedEncoding(nn.Linear(2, 2), out_lengths=lambda n: n, out_rows=lambda t: t.lengths)

    class Pool(nn.Module):  # one output row per `keep` input rows, `keep` from the table's metadata
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D_IN, D, dtype=torch.float64)

        def forward(self, values, offsets, keep):
            h = self.lin(values)
            return torch.cat([h[int(a) : int(a) + int(k)] for a, k in zip(offsets[:-1], keep)])

    from knitdata.media.multimodal import MediaOccurrences, MultimodalBatch

    enc = Pool()
    table = MediaTable("image", torch.randn(7, D_IN, dtype=torch.float64), torch.tensor([0, 3, 7]), ("a", "b"),
                       meta={"keep": torch.tensor([2, 1])})
    occ = [{"image": MediaOccurrences(torch.tensor([1, 0]), torch.tensor([0, 1]), torch.tensor([0, 0]))}]
    shared = SharedEncoding(enc, call=lambda e, t: e(t.values, t.offsets, t.meta["keep"]),
                            out_rows=lambda t: t.meta["keep"])
    with shared.minibatch(MultimodalBatch({"image": table}, occ)) as sm:
        rows = sm.rows(0)
        assert rows.shape == (3, D)  # item 1 (1 row), then item 0 (2 rows)
        sm.backward(rows.sum())
    ref = Pool()
    ref.load_state_dict(enc.state_dict())
    ref(table.values, table.offsets, table.meta["keep"]).sum().backward()
    torch.testing.assert_close(enc.lin.weight.grad, ref.lin.weight.grad)


def _agent_layout(rng: random.Random, *, siblings: int, turns: int, shared: int, k: int) -> list[list[Trajectory]]:
    """Per-turn samples of sibling agent episodes: turn t carries the history's t + 1 screenshots; the siblings share
    the first ``shared`` screenshots (one environment reset) and diverge after; shuffled into k micro-batches."""
    def shot() -> MediaItem:
        return MediaItem(kind="image", tensor=torch.randn(rng.randint(1, 3), D_IN, dtype=torch.float64))

    common = [shot() for _ in range(shared)]
    trajs = []
    for e in range(siblings):
        shots = common + [shot() for _ in range(turns - shared)]
        for t in range(turns):
            trajs.append(Trajectory(id=f"e{e}t{t}", source="gui", group="task", prompt_ids=torch.tensor([1, 2]),
                                    response_ids=torch.tensor([rng.randrange(50) for _ in range(2)]),
                                    media=shots[: t + 1]))
    rng.shuffle(trajs)
    cuts = sorted(rng.randint(0, len(trajs)) for _ in range(k - 1))
    bounds = [0, *cuts, len(trajs)]
    return [trajs[bounds[j] : bounds[j + 1]] for j in range(k)]


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), siblings=st.integers(1, 4), turns=st.integers(1, 4), shared=st.integers(0, 2),
       k=st.integers(1, 4), mode=st.sampled_from(["fold", "leaf", "recompute"]))
def test_agent_turn_samples_encode_each_screenshot_once_with_exact_gradients(seed, siblings, turns, shared, k, mode):
    """Digest keys on diverging sibling episodes: one encoder row block per distinct screenshot, naive's gradients."""
    shared = min(shared, turns)
    rng = random.Random(seed)
    mbs = _agent_layout(rng, siblings=siblings, turns=turns, shared=shared, k=k)
    batch = collate(mbs, "digest")
    distinct = shared + siblings * (turns - shared)
    assert batch.tables["image"].num_items == distinct
    assert batch.num_occurrences == siblings * turns * (turns + 1) // 2
    torch.manual_seed(seed)
    enc, bb = TinyEncoder(), TinyBackbone()
    scales = [1.0 / k] * k
    run_naive(enc, bb, batch, mbs, scales, "rows")
    want = grads(enc, bb)
    zero(enc, bb)
    seen: list[int] = []
    hook = enc.register_forward_pre_hook(lambda m, args: seen.append(int(args[1].numel()) - 1))
    run_shared(SharedEncoding(enc, mode=mode), bb, batch, mbs, scales, "rows")
    hook.remove()
    assert_grads_close(grads(enc, bb), want, torch.float64)
    assert seen[0] == distinct  # the first encode: every distinct screenshot once
