"""Shared helpers of the multimodal tests: tiny encoder/backbone, layouts, the naive reference path."""

from __future__ import annotations

import copy
import json
import math
import os
import random
import sys
import traceback

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from knitdata.media.encoder import SharedEncoding
from knitdata.media.multimodal import MultimodalBatch, MultimodalCollator
from knitdata.record import MediaItem, Trajectory

D_IN, D = 6, 8


def segments(offsets: torch.Tensor) -> torch.Tensor:
    lengths = offsets[1:] - offsets[:-1]
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=offsets.device), lengths)


class TinyEncoder(nn.Module):
    """Per-item self-attention over patch rows (items independent), optional checkpoint / pytree output."""

    def __init__(self, *, output: str = "rows", ckpt: bool = False, dtype=torch.float64):
        super().__init__()
        self.inp = nn.Linear(D_IN, D, dtype=dtype)
        self.v = nn.Linear(D, D, dtype=dtype)
        self.mlp = nn.Sequential(nn.Linear(D, D, dtype=dtype), nn.Tanh(), nn.Linear(D, D, dtype=dtype))
        self.output = output
        self.ckpt = ckpt

    def _block(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        att = (h @ h.T / math.sqrt(D)).masked_fill(~mask, float("-inf")).softmax(-1)
        h = h + att @ self.v(h)
        return h + self.mlp(h)

    def forward(self, values: torch.Tensor, offsets: torch.Tensor):
        seg = segments(offsets)
        mask = seg[:, None] == seg[None, :]
        h = torch.tanh(self.inp(values))
        h = checkpoint(self._block, h, mask, use_reentrant=False) if self.ckpt else self._block(h, mask)
        if self.output == "rows":
            return h
        lengths = (offsets[1:] - offsets[:-1]).to(h.dtype)
        pooled = torch.zeros(lengths.numel(), D, dtype=h.dtype).index_add(0, seg, h) / lengths[:, None]
        if self.output == "pooled":
            return pooled
        return {"rows": h, "pooled": pooled, "tag": "meta"}


class TinyBackbone(nn.Module):
    """Token embeddings plus a nonlinear function of each trajectory's media rows; a scalar loss."""

    def __init__(self, *, ckpt: bool = False, dtype=torch.float64, dense: bool = False):
        super().__init__()
        self.dense = dense  # every parameter takes part in every forward (DDP without find_unused_parameters)
        self.emb = nn.Embedding(50, D, dtype=dtype)
        self.w = nn.Linear(D, D, dtype=dtype)
        self.w2 = nn.Linear(D, D, dtype=dtype)
        self.head = nn.Linear(D, 1, dtype=dtype)
        self.ckpt = ckpt

    def _mix(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x + m)

    def forward(self, ids: list[torch.Tensor], rows, owner_rows: torch.Tensor | None, owner_pooled=None):
        n = len(ids)
        if n == 0:
            return sum(p.sum() for p in self.parameters()) * 0.0  # every parameter takes part (DDP)
        x = torch.stack([self.emb(t).mean(0) for t in ids])
        m = torch.zeros_like(x)
        if self.dense:
            m = m + 0.1 * torch.tanh(self.w(x)) + 0.1 * torch.sin(self.w2(x))
        if rows is not None:
            if isinstance(rows, dict):
                m = m.index_add(0, owner_rows, torch.tanh(self.w(rows["rows"])))
                m = m.index_add(0, owner_pooled, torch.sin(self.w2(rows["pooled"])))
            else:
                m = m.index_add(0, owner_rows, torch.tanh(self.w(rows)))
        h = checkpoint(self._mix, x, m, use_reentrant=False) if self.ckpt else self._mix(x, m)
        return (self.head(h).squeeze(-1) ** 2).sum()


def owners(batch: MultimodalBatch, i: int, output: str):
    occ = batch.for_microbatch(i).get("image")
    if occ is None or len(occ) == 0:
        return None, None
    table = batch.tables["image"]
    lens = table.lengths[occ.index]
    by_row = torch.repeat_interleave(occ.trajectory, lens)
    if output == "rows":
        return by_row, None
    if output == "pooled":
        return occ.trajectory, None
    return by_row, occ.trajectory


def make_layout(
    rng: random.Random, *, groups: int, group_size: int, max_items: int, max_len: int, k: int, dtype=torch.float64
) -> list[list[Trajectory]]:
    """Random GRPO-like layout: groups share media (some groups none), shuffled into k micro-batches."""
    trajs = []
    shared = MediaItem(kind="image", tensor=torch.randn(rng.randint(1, max_len), D_IN, dtype=dtype))
    for g in range(groups):
        n_items = rng.randint(0, max_items)
        media = [MediaItem(kind="image", tensor=torch.randn(rng.randint(1, max_len), D_IN, dtype=dtype)) for _ in range(n_items)]
        if n_items and rng.random() < 0.3:
            media.append(shared)  # one image shared across prompts (digest keys find it)
        for r in range(group_size):
            trajs.append(
                Trajectory(
                    id=f"g{g}r{r}",
                    source="vision",
                    group=f"g{g}",
                    prompt_ids=torch.tensor([rng.randrange(50) for _ in range(rng.randint(0, 4))], dtype=torch.long),
                    response_ids=torch.tensor([rng.randrange(50) for _ in range(rng.randint(1, 4))]),
                    media=list(media),
                )
            )
    rng.shuffle(trajs)
    cuts = sorted(rng.randint(0, len(trajs)) for _ in range(k - 1))
    bounds = [0, *cuts, len(trajs)]
    return [trajs[bounds[j] : bounds[j + 1]] for j in range(k)]


def ids_of(mb: list[Trajectory]) -> list[torch.Tensor]:
    return [torch.cat([t.prompt_ids, t.response_ids]) for t in mb]


def grads(*modules: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for mi, m in enumerate(modules):
        for name, p in m.named_parameters():
            g = p.grad
            if g is not None and hasattr(g, "full_tensor"):
                g = g.full_tensor()
            out[f"{mi}.{name}"] = torch.zeros_like(p) if g is None else g.detach().clone()
    return out


def zero(*modules: nn.Module) -> None:
    for m in modules:
        for p in m.parameters():
            p.grad = None


def run_naive(encoder, backbone, batch: MultimodalBatch, mbs, scales, output: str) -> None:
    """The reference: every micro-batch re-encodes its own copies (independent of SharedEncoding)."""
    table = batch.tables.get("image")
    for i, mb in enumerate(mbs):
        occ = batch.for_microbatch(i).get("image")
        rows = None
        if occ is not None and len(occ):
            sub = table.gather(occ.index)
            rows = encoder(sub.values, sub.offsets)
        o_rows, o_pooled = owners(batch, i, output)
        loss = backbone(ids_of(mb), rows, o_rows, o_pooled) * scales[i]
        loss.backward()


def run_shared(enc: SharedEncoding, backbone, batch: MultimodalBatch, mbs, scales, output: str, sync=None) -> None:
    with enc.minibatch(batch) as shared:
        for i, mb in enumerate(mbs):
            ctx = sync(i) if sync is not None else None
            if ctx is not None:
                ctx.__enter__()
            rows = shared.rows(i)
            o_rows, o_pooled = owners(batch, i, output)
            loss = backbone(ids_of(mb), rows, o_rows, o_pooled) * scales[i]
            shared.backward(loss)
            if ctx is not None:
                ctx.__exit__(None, None, None)


def assert_grads_close(a: dict, b: dict, dtype) -> None:
    assert a.keys() == b.keys()
    big = max((float(v.abs().max()) for v in b.values() if v.numel()), default=0.0)
    for k in a:
        if dtype == torch.float64:
            torch.testing.assert_close(a[k], b[k], rtol=1e-10, atol=1e-10 * max(big, 1e-30), msg=lambda m, k=k: f"{k}: {m}")
        else:
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6 * max(big, 1e-30), msg=lambda m, k=k: f"{k}: {m}")


def collate(mbs, key: str = "digest") -> MultimodalBatch:
    return MultimodalCollator(key=key)(mbs)


# ------------------------------------------------------------------ distributed worker (spawned)

# (name, wrapper, mode, rank 1 without media)
SCENARIOS = [
    ("ddp1_fold", "ddp_one", "fold", False),
    ("ddp1_fold_nomedia", "ddp_one", "fold", True),
    ("ddp2_fold_nomedia", "ddp_two", "fold", True),
    ("ddp2_leaf_nomedia", "ddp_two", "leaf", True),
    ("ddp2_recompute_nomedia", "ddp_two", "recompute", True),
    ("ddp2_naive", "ddp_two", "naive", True),
    ("fsdp2_fold_nomedia", "fsdp2", "fold", True),
    ("fsdp2_leaf", "fsdp2", "leaf", False),
    ("fsdp2_recompute_nomedia", "fsdp2", "recompute", True),
]


def dist_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from knitdata.media.encoder import SharedEncoding, grad_sync
    from knitdata.media.multimodal import MediaTable

    dist.init_process_group("gloo", rank=rank, world_size=world)
    results: dict = {}
    dummy = MediaTable.empty_like("image", (D_IN,), torch.float64, length=2)

    class Model(nn.Module):
        def __init__(self, enc, bb):
            super().__init__()
            self.encoder, self.backbone = enc, bb

        def forward(self, *a):
            return self.backbone(*a)

    only = os.environ.get("KNITDATA_MM_SCENARIOS")
    for si, (name, wrapper, mode, nomedia) in enumerate(SCENARIOS):
        if only and name not in only.split(","):
            continue
        print(f"[rank {rank}] {name}", flush=True)
        try:
            torch.manual_seed(100 + si)  # same parameters on every rank
            enc0, bb0 = TinyEncoder(output="tree"), TinyBackbone(dense=True)
            rng = random.Random(1000 * si + rank)
            mbs = make_layout(rng, groups=3, group_size=3, max_items=0 if (nomedia and rank == 1) else 2, max_len=4, k=3)
            batch = collate(mbs, "provenance")
            scales = [1.0, 0.5, 2.0]
            ref_enc, ref_bb = copy.deepcopy(enc0), copy.deepcopy(bb0)
            run_naive(ref_enc, ref_bb, batch, mbs, scales, "tree")
            ref = grads(ref_enc, ref_bb)
            for v in ref.values():
                dist.all_reduce(v)
                v /= world
            enc, bb = copy.deepcopy(enc0), copy.deepcopy(bb0)
            if wrapper == "ddp_one":
                model = DDP(Model(enc, bb))
                se = SharedEncoding(model.module.encoder, mode=mode, dummy_input=dummy)
                run_shared(se, model, batch, mbs, scales, "tree", sync=lambda i, m=model: grad_sync(m, i == 2))
            elif wrapper == "ddp_two":
                denc, dbb = DDP(enc), DDP(bb)
                se = SharedEncoding(denc, mode=mode, dummy_input=dummy, chunk_items=1)
                run_shared(se, dbb, batch, mbs, scales, "tree", sync=lambda i, m=dbb: grad_sync(m, i == 2))
            else:
                from torch.distributed.device_mesh import init_device_mesh
                from torch.distributed.fsdp import fully_shard

                mesh = init_device_mesh("cpu", (world,))
                fully_shard(enc, mesh=mesh)
                fully_shard(bb, mesh=mesh)
                se = SharedEncoding(enc, mode=mode, dummy_input=dummy, chunk_items=1)
                run_shared(se, bb, batch, mbs, scales, "tree", sync=lambda i, m=bb: grad_sync(m, i == 2))
            got = grads(enc, bb)
            big = max(float(v.abs().max()) for v in ref.values())
            err = max(float((got[k] - ref[k]).abs().max()) for k in ref) / big
            flat = torch.cat([v.reshape(-1) for v in got.values()])
            other = [torch.zeros_like(flat) for _ in range(world)]
            dist.all_gather(other, flat)
            same = all(bool(torch.equal(other[0], o)) for o in other)
            enc_grad = max(float(v.abs().max()) for k, v in got.items() if k.startswith("0."))
            results[name] = {"rel_err": err, "same_on_ranks": same, "encoder_grad_max": enc_grad}
            zero(enc, bb)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
            print(f"[rank {rank}] {name} failed:\n{results[name]['error']}", flush=True)
            break  # collectives may be out of step now: stop rather than hang
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()
    # the results are written: skip the interpreter's teardown, where a C++ thread left joinable at exit aborts the
    # process now and then ("terminate called without an active exception", SIGABRT) after all the work was done
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


