"""Ray scenarios of media stored and moved once (issue 43), run in driver subprocesses against the cluster of
``tests/_ray_helpers.py`` (``python tests/_ray_media_scenarios.py scenario NAME --address ADDR --args JSON``).

Each scenario returns JSON: counts and bytes the tests in ``tests/test_storage_ray_media.py`` assert on.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _ray_helpers as rh  # noqa: E402

__all__ = ["run_media_scenario", "group_media_trajs"]


def run_media_scenario(address: str, name: str, timeout_s: float = 240.0, **kwargs: Any) -> dict[str, Any]:
    """Run scenario ``name`` of this module in a fresh driver subprocess attached to ``address``."""
    import json

    cmd = [rh.PY, str(Path(__file__).resolve()), "scenario", name, "--address", address, "--args", json.dumps(kwargs)]
    return rh.run_json_subprocess(cmd, f"scenario {name!r}", timeout_s)


def _frames(seed: int, shape: tuple[int, ...]) -> Any:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)


def group_media_trajs(n_groups: int, group_size: int, *, first: int = 0, big: tuple[int, ...] = (2, 3, 96, 96),
                      refs: bool = False, source: str = "math", tokens: int = 16) -> list[Any]:
    """Groups whose members share a video (``big``: object-store sized) and an image, each with its own small clip.

    ``refs``: members after the first put :meth:`MediaItem.ref <knitdata.record.MediaItem.ref>` for the shared items.
    """
    import torch

    from knitdata.record import MediaItem, Trajectory

    out = []
    for g in range(n_groups):
        video = MediaItem("video", tensor=_frames(1000 + first + g, big))
        image = MediaItem("image", tensor=_frames(5000 + first + g, (3, 16, 16)))
        for k in range(group_size):
            i = first + g * group_size + k
            gen = torch.Generator().manual_seed(i)
            clip = MediaItem("audio", tensor=torch.rand(32, generator=gen), sample_rate=16000)
            shared = [video, image] if k == 0 or not refs else [MediaItem.ref("video", video.digest),
                                                               MediaItem.ref("image", image.digest)]
            out.append(Trajectory(id=f"t{i}", source=source, group=f"g{first + g}", prompt_ids=torch.arange(8),
                                  response_ids=torch.randint(0, 1000, (tokens,), generator=gen),
                                  scalars={"reward": float(i)}, media=[*shared, clip]))
    return out


def _err(fn: Any) -> list[Any]:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - reported
        return [type(e).__name__, getattr(e, "trajectory_id", None), getattr(e, "field", None), str(e),
                getattr(e, "digest", None)]
    return ["ok"]


def _equal(got: list[Any], want: list[Any]) -> bool:
    return len(got) == len(want) and all(a.equals(b) for a, b in zip(got, want))


@rh.scenario
def media_units() -> dict[str, Any]:
    """Units on two nodes: one copy per digest with exact counts through put, references (held, held by the other
    unit, held nowhere), reads (each item once, one object per digest), release, a client's stale view, spill
    write-through and spill-over, a unit's death and recovery from its spill, and per-trajectory copies."""
    import ray

    from knitdata.codec import decode_trajectory, encode_media, encode_trajectory
    from knitdata.engines.ray.metrics import TransferMeter
    from knitdata.engines.ray.unit import RayStorageUnit, decode_records, read_records
    from knitdata.engines.ray.unit_actor import SpillRecovery
    from knitdata.record import MediaItem

    nodes = rh._nodes()
    units = RayStorageUnit.create_many([("u0", nodes[0]), ("u1", nodes[1])], 1 << 24, prefix="media")
    u0, u1 = units["u0"], units["u1"]
    out: dict[str, Any] = {}
    trajs = group_media_trajs(2, 4)
    distinct = {m.digest: m for t in trajs for m in t.media}
    out["distinct_media_bytes"] = sum(m.nbytes for m in distinct.values())
    out["own_bytes"] = sum(t.nbytes - sum(m.nbytes for m in t.media) for t in trajs)
    out["logical_bytes"] = sum(t.nbytes for t in trajs)
    out["media_record_bytes"] = sum(len(encode_media(m)) for m in distinct.values())
    out["traj_record_bytes"] = sum(len(encode_trajectory(t, media="refs")) for t in trajs)
    out["put_many"] = u0.put_many(trajs)
    out["put_meter"] = u0.meter.to_dict()["put"]
    out["after_put"] = {"stats": u0.stats().to_dict(), "check": u0.media_check()}
    # reads: each distinct item once per request, equal digests one object, zero-copy
    meter = TransferMeter()
    media: dict[str, Any] = {}
    recs = read_records([(t.id, u0) for t in trajs], meter=meter, mode="eager", placement="p", step=0, media=media)
    got = decode_records(recs, media)
    out["read"] = {"equal": _equal(got, trajs), "bytes": meter.to_dict()["read"]["p/eager"],
                   "same_object": all(g.media[0] is got[0].media[0] for g in got[:4]),
                   "media_fetched": len(media), "writable": bool(recs[0].flags.writeable)}
    again = read_records([(t.id, u0) for t in trajs[:4]], meter=meter, mode="eager", placement="p", step=0,
                         media=media)  # the same share again: its media are held by the reader already
    out["read_again_bytes"] = meter.to_dict()["read"]["p/eager"]["local_bytes"] - out["read"]["bytes"]["local_bytes"]
    out["read_again_records"] = sum(int(r.nbytes) for r in again)
    pair = u0.get([trajs[0].id, trajs[1].id])
    out["get_same_object"] = pair[0].media[0] is pair[1].media[0]
    out["get_records_decode"] = _equal([decode_trajectory(r) for r in u0.get_records([trajs[0].id])], trajs[:1])
    # references: held here, held by the other unit (copied in), held nowhere (refused, nothing stored)
    video = trajs[0].media[0]
    ref_t = group_media_trajs(1, 1, first=100)[0]
    ref_t.media = [MediaItem.ref("video", video.digest), ref_t.media[2]]
    out["ref_here"] = _err(lambda: u0.put(ref_t))
    other = group_media_trajs(1, 1, first=200)[0]
    u1.put(other)
    u0.resolve = lambda d: u1.media_record(d)
    cross = group_media_trajs(1, 1, first=300)[0]
    cross.media = [MediaItem.ref("video", other.media[0].digest)]
    out["ref_other_unit"] = _err(lambda: u0.put(cross))
    held = u0.get([cross.id])[0].media[0]
    out["ref_other_equal"] = held.digest == other.media[0].digest and bool((held.tensor == other.media[0].tensor).all())
    bad = group_media_trajs(1, 1, first=400)[0]
    bad.media = [bad.media[2], MediaItem.ref("image", "ab" * 16)]
    before = u0.stats().to_dict()
    out["ref_nowhere"] = _err(lambda: u0.put(bad))
    out["ref_nowhere_admit"] = _err(lambda: u0.put_admit([bad], [[{}, 1, None]]))
    out["ref_nowhere_unchanged"] = {k: (before[k], u0.stats().to_dict()[k])
                                    for k in ("used_bytes", "num_items", "media_items", "media_refs")}
    out["contains_bad"] = u0.contains(bad.id)
    out["after_refs"] = {"stats": u0.stats().to_dict(), "check": u0.media_check()}
    # release: counts exact at every point, nothing freed while referenced, nothing left after
    out["release_half"] = u0.release([t.id for t in trajs[:2]] + [trajs[4].id])
    out["after_half"] = {"stats": u0.stats().to_dict(), "check": u0.media_check(),
                         "still_equal": _equal(u0.get([t.id for t in trajs[2:4]]), trajs[2:4])}
    u0.release([t.id for t in trajs] + [ref_t.id, cross.id])
    out["after_all"] = {"stats": u0.stats().to_dict(), "check": u0.media_check()}
    # the client believes the unit holds the video (sent before); the unit freed it: "missing", content resent
    again_t = group_media_trajs(1, 1, first=0)[0]
    again_t.id = "t-again"
    out["resent"] = _err(lambda: u0.put(again_t))
    out["resent_equal"] = u0.get(["t-again"])[0].equals(again_t)
    # spill: write-through (each media item once on disk) and spill-over (own record on disk, media in memory)
    spill_root = tempfile.mkdtemp(prefix="kd-media-spill-")
    group = group_media_trajs(1, 4, tokens=200)  # own records (~1.7 kB) larger than a clip (128 B)
    room = group[0].nbytes + sum(t.media[2].nbytes for t in group[1:]) + 100  # the first + every media item
    sp = RayStorageUnit.create("sp", nodes[1], room, prefix="media", spill_dir=spill_root)
    out["spill_put"] = sp.put_many(group)
    out["spill"] = {"stats": sp.stats().to_dict(), "check": sp.media_check(),
                    "spill_stats": ray.get(sp.actor.spill_stats.remote()),
                    "equal": _equal(sp.get([t.id for t in group]), group)}
    sp.release([group[0].id])
    out["spill_after_release"] = {"stats": sp.stats().to_dict(), "check": sp.media_check()}
    sp.kill()  # the unit dies: its trajectories and media together; the spill has both
    rec = SpillRecovery(spill_root)
    found = rec.records("sp", [t.id for t in group])
    out["recovered"] = {"ids": sorted(found), "equal": all(decode_trajectory(found[t.id]).equals(t)
                                                           for t in group[1:] if t.id in found)}
    rec.close()
    # per-trajectory copies: every record carries its media; references refused
    nd = RayStorageUnit.create("nd", nodes[0], 1 << 24, prefix="media", media_dedup=False)
    nd.put_many(trajs)
    out["copies"] = {"stats": nd.stats().to_dict(), "check": nd.media_check(),
                     "ref": _err(lambda: nd.put(ref_t)), "equal": _equal(nd.get([t.id for t in trajs]), trajs)}
    for u in (u0, u1, nd):
        u.kill()
    return out


@rh.scenario
def media_resume() -> dict[str, Any]:
    """A whole-job restart from a unit's write-through spill: the new unit rebuilds the media counts of the
    unreleased payloads from the spilled records and media samples, serves them, and frees them exactly."""
    from knitdata.engines.ray.unit import RayStorageUnit

    nodes = rh._nodes()
    spill_root = tempfile.mkdtemp(prefix="kd-media-resume-")
    trajs = group_media_trajs(2, 4, refs=True)
    full = group_media_trajs(2, 4)
    first = RayStorageUnit.create_many([("ru", nodes[0])], 1 << 24, prefix="mresume", spill_dir=spill_root)["ru"]
    first.put_many(trajs)
    first.release([trajs[0].id, trajs[4].id, trajs[5].id])  # released before the job died
    before = {"stats": first.stats().to_dict(), "check": first.media_check()}
    first.kill()
    time.sleep(0.5)
    unit = RayStorageUnit.create_many([("ru", nodes[0])], 1 << 24, prefix="mresume2", spill_dir=spill_root,
                                      resume=True)["ru"]
    left = [t.id for t in trajs if t.id not in (trajs[0].id, trajs[4].id, trajs[5].id)]
    after = {"stats": unit.stats().to_dict(), "check": unit.media_check()}
    by_id = {t.id: t for t in full}
    equal = _equal(unit.get(left), [by_id[i] for i in left])
    unit.release(left)
    end = {"stats": unit.stats().to_dict(), "check": unit.media_check()}
    unit.kill()
    return {"before": before, "after": after, "equal": equal, "end": end, "left": len(left)}


def _share_bytes(trajs: list[Any], full: list[Any], ids: list[str]) -> int:
    """Bytes a share moves when each distinct media item goes once: its records as put (``trajs``) without media +
    each item (its content from ``full``) once."""
    from knitdata.codec import encode_media, encode_trajectory

    by_id = {t.id: t for t in trajs}
    share = [by_id[i] for i in ids]
    content = {t.id: t for t in full}
    media = {m.digest: m for i in ids for m in content[i].media}
    return sum(len(encode_trajectory(t, media="refs")) for t in share) + sum(len(encode_media(m))
                                                                          for m in media.values())


@rh.scenario
def media_moved_once(fetch: str = "eager", n_groups: int = 8, group_size: int = 4) -> dict[str, Any]:
    """Two ranks on one node consume groups sharing a video through ``fetch``: the bytes each step moves (the
    engine's read counters, the units' bytes_fetched) against records + distinct media; then the same workload
    with per-trajectory copies."""
    from knitdata import Pipeline
    from knitdata.admission import BatchSpec
    from knitdata.placement import ConsumerLayout

    out: dict[str, Any] = {}
    trajs = group_media_trajs(n_groups, group_size, refs=True)
    full = group_media_trajs(n_groups, group_size)  # the same content, every member carrying it
    spec = BatchSpec({"math": n_groups * group_size // 2}, num_minibatches=1, group_size=group_size)
    for dedup in (True, False):
        name = f"mm-{os.getpid()}-{dedup}"
        pipe = Pipeline(spec, layout=ConsumerLayout(["n0", "n0"]), engine="ray", token_budget=4 * 24,
                        capacity_bytes=64 << 20, release="commit", media_dedup=dedup,
                        engine_options={"nodes": rh._nodes()[:1], "name": name})
        for t in (trajs if dedup else full):
            pipe.put(t)
        pipe.close()
        stored = {u: s["used_bytes"] for u, s in pipe.stats()["units"].items()}
        shares: dict[str, list[str]] = {}
        for rank in range(2):
            ds = pipe.dataset(rank, fetch=fetch, timeout=60)
            for mb in ds:
                shares.setdefault(f"{mb.info.minibatch}", []).extend(mb.info.trajectory_ids)
            ds.commit(wait=True)  # released: the units hold nothing after
        engine = pipe.internals
        pipe.internals.flush_meter()
        stats = pipe.stats()  # this process's read counters, flushed to the coordinator or not
        read = stats["transfer"]["read"]
        out["dedup" if dedup else "copies"] = {
            "stored": stored, "shares": shares, "read": read,
            "expected_moved": {s: _share_bytes(trajs, full, ids) for s, ids in shares.items()},
            "units_bytes_fetched": sum(u["bytes_fetched"] for u in stats["units"].values()),
            "held_after": {u: s["used_bytes"] for u, s in stats["units"].items()},
            "media_check": {u: unit.media_check() for u, unit in engine.units.items()},
            "full_bytes": sum(t.nbytes for t in full)}
        pipe.shutdown()
    return out


@rh.scenario
def media_faults(spill_root: str, n_groups: int = 6, group_size: int = 4, kills: int = 2) -> dict[str, Any]:
    """Counts through faults: the coordinator killed (SIGKILL, restarted from its journal) while groups that share
    media are put and consumed; a unit killed with its spill written through (its trajectories and media lost
    together, recovered from the spill with their media)."""
    import threading

    import ray

    from knitdata import Pipeline
    from knitdata.admission import BatchSpec
    from knitdata.engines.ray.connect import NAMESPACE
    from knitdata.engines.ray.engine import coordinator_name
    from knitdata.placement import ConsumerLayout

    out: dict[str, Any] = {}
    spec = BatchSpec({"math": group_size * 2}, num_minibatches=1, group_size=group_size)
    # coordinator killed
    name = f"mf-ck-{os.getpid()}"
    pipe = Pipeline(spec, num_consumers=2, engine="ray", token_budget=4 * 24, capacity_bytes=64 << 20,
                    engine_options={"nodes": rh._nodes()[:1], "name": name, "journal_dir": spill_root})
    trajs = group_media_trajs(n_groups, group_size, refs=True)
    got: list[list[str]] = [[], []]
    errors: list[str] = []

    def consume(rank: int) -> None:
        try:
            for mb in Pipeline.attach(name).dataset(rank, fetch="iter", timeout=120):
                got[rank].extend(mb.info.trajectory_ids)
        except Exception as e:  # noqa: BLE001 - reported
            errors.append(f"rank {rank}: {type(e).__name__}: {e}")

    actor = ray.get_actor(coordinator_name(name), namespace=NAMESPACE)
    every = max(1, len(trajs) // (kills + 1))
    killed = 0
    checks = []
    for i, t in enumerate(trajs):
        pipe.put(t)
        if i and i % every == 0 and killed < kills:
            ray.kill(actor, no_restart=False)
            killed += 1
            checks.append({u: unit.media_check() for u, unit in pipe.internals.units.items()})
    out["after_put"] = {u: [unit.media_check(), unit.stats().to_dict()] for u, unit in pipe.internals.units.items()}
    pipe.close()
    threads = [threading.Thread(target=consume, args=(r,)) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(180)
    out["coordinator"] = {"got": got, "all_ids": [t.id for t in trajs], "errors": errors, "killed": killed,
                          "checks": checks, "restarted": pipe.internals.control.plumbing.info()["restarted"],
                          "after": {u: [unit.media_check(), unit.stats().to_dict()]
                                    for u, unit in pipe.internals.units.items()}}
    pipe.shutdown()
    # a unit killed: trajectories and media lost together, recovered from the spill
    nodes = rh._nodes()
    name = f"mf-uk-{os.getpid()}"
    pipe = Pipeline(spec, layout=ConsumerLayout(["n0", "n1"]), engine="ray", token_budget=4 * 24,
                    capacity_bytes=64 << 20, spill_dir=os.path.join(spill_root, name),
                    engine_options={"nodes": nodes[:2], "name": name})
    trajs = group_media_trajs(n_groups, group_size, first=1000)
    metas = [pipe.put(t) for t in trajs]
    pipe.close()
    out["unit_before"] = {u: [unit.media_check(), unit.stats().to_dict()] for u, unit in pipe.internals.units.items()}
    pipe.internals.kill_unit("n1")
    time.sleep(0.5)
    by_id = {t.id: t for t in trajs}
    lost = [m for m in metas if m.location == "n1"]
    recovered = pipe.internals.read([[m.id, m.location, m.nbytes] for m in lost], fetch=_eager(), step=-1)
    seen: list[str] = []
    for rank in range(2):
        for mb in pipe.dataset(rank, fetch="eager", timeout=60):
            seen.extend(mb.info.trajectory_ids)
    out["unit"] = {"seen": seen, "all_ids": sorted(by_id), "on_n1": sorted(m.id for m in lost),
                   "recovered_equal": _equal(recovered, [by_id[m.id] for m in lost]),
                   "n0_after": [pipe.internals.units["n0"].media_check(), pipe.internals.units["n0"].stats().to_dict()]}
    pipe.shutdown()
    return out


def _eager() -> Any:
    from knitdata.consumer.fetch import fetch_mode

    return fetch_mode("eager")


def main(argv: list[str]) -> int:
    """Entry point of the subprocesses (the scenarios of this module registered with ``_ray_helpers``)."""
    return rh.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
