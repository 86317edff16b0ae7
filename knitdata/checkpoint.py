"""Whole-pipeline checkpoints: save a running pipeline to a directory, restore it in a new process.

A checkpoint (:func:`write_checkpoint`, called by :meth:`knitdata.Pipeline.checkpoint`) is a directory holding

* ``manifest.json``: the format, the configuration and its fingerprint (:func:`config_fingerprint`), the
  control plane's state at the cut (admitted mini-batches and their plans, positions, finished but unadmitted
  trajectories, incomplete groups, withdrawn groups), the rollout ledger (prompts in flight) and the prompts to
  reissue, and the list of payload shards;
* ``payloads-NNNNNN.tar``: the payloads of every trajectory the plane still held at the cut (admitted and not
  released, or not admitted yet), as webdataset tar shards (:mod:`knitdata.shards`: JSON header, ``.npy``
  tensors, CRC32s; no pickle). Each media item's content is written once, with the first payload using it; the
  later ones refer to it by digest (media encoding ``"ref"``), and a restore gives every payload of a digest the
  same item again, so the units hold and count it once as before. Checkpoints written before this keep loading
  (every payload carries its own copies; a restore holds one per digest).

The cut is taken under the plane's lock (the only pause trainers can see; reported as ``pause_ms``); releases of
the payloads it holds are deferred until the payloads are written (:mod:`knitdata.control.ledger`). The
directory is written next to ``path`` and renamed into place, so a crash leaves the previous checkpoint whole.

:func:`restore_into` loads a checkpoint into a freshly built engine (:meth:`knitdata.Pipeline.restore`): the
same or another topology (nodes, units, engine, number of ranks). :func:`remap_plane_state` converts the cut's
plane state to the new units. Onto another number of ranks, the plane is restored in its saved layout (plans,
positions and fingerprints as they were at the cut), then the elastic resume
(:meth:`knitdata.control.reshape.Reshaping.reshape`) continues it on the new layout from the merged states of all
old ranks (:func:`knitdata.merge_rank_states`).

Example:
    >>> fp, parts = config_fingerprint({"spec": {"quotas": {"a": 2}}, "layout": {"nodes_of_ranks": ["n0"]},
    ...                                 "token_budget": 64})
    >>> len(fp), parts["num_consumers"]
    (16, 1)
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from knitdata.consumer.fetch import fetch_mode
from knitdata.control import PLANE_DEFAULTS
from knitdata.control.ledger import Ledger
from knitdata.errors import ConfigError, KnitdataError, StateError, StoreFull
from knitdata.placement import ConsumerLayout
from knitdata.record import MediaItem, Trajectory
from knitdata.shards import read_shards, write_shards

__all__ = [
    "CHECKPOINT_FORMAT",
    "FINGERPRINT_KEYS",
    "CheckpointInfo",
    "RestoreReport",
    "RolloutLedger",
    "config_fingerprint",
    "write_checkpoint",
    "read_manifest",
    "check_fingerprint",
    "remap_plane_state",
    "saved_layout",
    "restore_into",
    "restore_pipeline",
    "lost_groups",
]

#: The format name and version of ``manifest.json``.
CHECKPOINT_FORMAT = ("knitdata-checkpoint", 1)
#: The configuration keys the fingerprint covers (besides the number of ranks): what decides admission and plans.
FINGERPRINT_KEYS: tuple[str, ...] = ("spec", "token_budget", "admission", "admission_options", "placement",
                                     "allow_split_groups", "balance_tolerance", "release")
_READ_CHUNK = 256  # payloads read from the units per request while writing


def _num_consumers(layout: Any) -> int:
    return int(ConsumerLayout.from_dict(layout).num_consumers) if isinstance(layout, Mapping) else 0


def config_fingerprint(config: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """The fingerprint of a pipeline's configuration: a 64-bit BLAKE2b digest (hex) and what it covers.

    It covers the batch spec, the number of ranks, the token budget, the admission policy and its options, the
    placement, the planner's options and the release mode; not the nodes, units or capacities (a restore may
    change the topology).
    """
    cfg = {**PLANE_DEFAULTS, **dict(config)}
    parts = {k: cfg.get(k) for k in FINGERPRINT_KEYS}
    parts["num_consumers"] = _num_consumers(cfg.get("layout"))
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest(), parts


@dataclass(frozen=True)
class CheckpointInfo:
    """What :meth:`knitdata.Pipeline.checkpoint` wrote.

    Attributes:
        path: The checkpoint directory.
        fingerprint: The configuration's fingerprint.
        trajectories: Payloads written (every trajectory the plane held at the cut).
        bytes: Bytes of the payload shards.
        pause_ms: Milliseconds the control plane's lock was held for the cut (trainers wait at most this long).
        write_s: Seconds to write the payloads and the manifest (trainers keep running meanwhile).
        in_flight: Prompts started and not finished at the cut (to reissue after a restore).
        admitted_entries: Planned micro-batches not yet released, over every rank.
    """

    path: str
    fingerprint: str
    trajectories: int
    bytes: int
    pause_ms: float
    write_s: float
    in_flight: int
    admitted_entries: int

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable dict."""
        return asdict(self)


@dataclass(frozen=True)
class RestoreReport:
    """What :meth:`knitdata.Pipeline.restore` restored.

    Attributes:
        path: The checkpoint directory.
        trajectories: Payloads put back into the storage units.
        reissue: The prompts the producer must reissue (started and not finished at the cut), in start order:
            dicts with ``prompt_id``, ``group``, ``have`` (ids of its trajectories the checkpoint holds: do not
            generate them again), ``missing`` (how many to generate) and ``withdrawn``.
        unit_map: Old storage unit -> new storage unit.
        config_changed: Whether the configuration's fingerprint differed (restored with ``allow_config_change``).
        merged_state: Restored onto another number of ranks: the merged state of the old ranks
            (:func:`knitdata.merge_rank_states`) that every new rank loads (``ds.load_state_dict(merged_state)``)
            instead of its own saved state; ``None`` otherwise.
        reshaped: Restored onto another number of ranks: ``{"from_ranks", "to_ranks", "replanned", "segments"}``
            (the elastic resume's result); ``None`` otherwise.
    """

    path: str
    trajectories: int
    reissue: list[dict[str, Any]] = field(default_factory=list)
    unit_map: dict[str, str] = field(default_factory=dict)
    config_changed: bool = False
    merged_state: dict[str, Any] | None = None
    reshaped: dict[str, Any] | None = None

    @property
    def reissue_ids(self) -> list[str]:
        """The prompt ids to reissue whose trajectories are not all held yet (``missing > 0``)."""
        return [r["prompt_id"] for r in self.reissue if r["missing"] > 0]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable dict."""
        return {**asdict(self), "reissue_ids": self.reissue_ids}


class RolloutLedger:
    """The producer's record of prompts in flight (``pipe.ledger``): what a checkpoint tells it to reissue.

    Call :meth:`started` when a prompt's rollout begins and :meth:`finished` right after its last trajectory was
    put (or when it is given up). A checkpoint saves the prompts started and not finished; after
    :meth:`knitdata.Pipeline.restore` they are in ``pipe.restore_report.reissue`` (still in flight: reissue them
    and call :meth:`finished` when done). A prompt whose trajectories were all consumed before it was reported
    finished cannot be told apart from one not started: report :meth:`finished` right after the put returns.

    Args:
        control: The control plane's ledger part (:class:`~knitdata.control.ledger.Ledger`, or its proxy on the
            Ray engine).
    """

    def __init__(self, control: Ledger) -> None:
        self._control = control

    def started(self, prompt_id: str | Sequence[str], *, group: str | None = None, n: int | None = None) -> int:
        """Record prompt(s) whose rollout begins; ``group`` (default: the prompt id) and ``n`` (default: the spec's
        group size) describe the trajectories it yields. Returns how many prompts are in flight."""
        ids = [prompt_id] if isinstance(prompt_id, str) else list(prompt_id)
        groups = [group] * len(ids) if group is not None else None
        counts = [n] * len(ids) if n is not None else None
        return int(self._control.ledger_started(ids, groups, counts))

    def finished(self, prompt_id: str | Sequence[str]) -> int:
        """Record prompt(s) whose trajectories were all put (or given up). Returns how many are in flight."""
        ids = [prompt_id] if isinstance(prompt_id, str) else list(prompt_id)
        return int(self._control.ledger_finished(ids))

    def in_flight(self) -> list[str]:
        """The prompts started and not finished, in start order."""
        return [row[0] for row in self._control.ledger_state()["in_flight"]]

    def num_finished(self) -> int:
        """How many prompts were reported finished over the run (restored with a checkpoint): a producer that
        starts its prompts in order resumes at ``num_finished() + len(in_flight())``."""
        return int(self._control.ledger_state()["finished"])


# ------------------------------------------------------------------------------------------------ write
def _payloads(engine: Any, live: Sequence[Mapping[str, Any]]) -> Iterator[Trajectory]:
    """The payloads of ``live`` (metadata dicts with ``id`` and ``location``), read from the units in chunks."""
    mode = fetch_mode("sample")
    items = [[m["id"], m["location"], 0] for m in live]
    for k in range(0, len(items), _READ_CHUNK):
        yield from engine.read(items[k:k + _READ_CHUNK], fetch=mode, step=-1)


def _media_once(trajs: Iterator[Trajectory]) -> Iterator[Trajectory]:
    """``trajs`` with each media item's content written once: a later trajectory using a digest already written
    gets a reference to it (shard media encoding ``"ref"``; :func:`_resolve_media` puts the item back)."""
    written: set[str] = set()
    for t in trajs:
        if not t.media:
            yield t
            continue
        media = []
        for m in t.media:
            if m.digest in written or m.reference:
                media.append(m if m.reference else MediaItem.ref(m.kind, m.digest, sample_rate=m.sample_rate))
            else:
                written.add(m.digest)
                media.append(m)
        if any(a is not b for a, b in zip(media, t.media)):
            t = copy.copy(t)  # the unit's object keeps its items
            t.media = media
        yield t


def _resolve_media(traj: Trajectory, held: dict[str, MediaItem], path: str) -> Trajectory:
    """A restored trajectory's media: one object per digest (the first read), references resolved from it."""
    if not traj.media:
        return traj
    out = []
    for i, m in enumerate(traj.media):
        item = held.get(m.digest)
        if item is None:
            if m.reference:
                raise StateError(f"checkpoint {path!r}: payload {traj.id!r} refers to media {m.digest} (media index "
                                 f"{i}) that no earlier payload of its shards holds: damaged checkpoint")
            item = held[m.digest] = m
        out.append(item)
    traj.media = out
    return traj


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_checkpoint(engine: Any, path: str | os.PathLike[str], *, options: Mapping[str, Any]) -> CheckpointInfo:
    """Checkpoint the pipeline of ``engine`` to the directory ``path`` (replaced atomically if it exists).

    Args:
        engine: The pipeline's engine (:class:`~knitdata.engines.base.Engine`).
        path: The checkpoint directory.
        options: The pipeline's own options to save (``capacity_bytes``, ``put_timeout``, ...).

    Raises:
        StateError: Another checkpoint is in progress.
        TrajectoryLostError: A payload could be neither read nor recovered (a dead unit without spill).
        OSError: The directory could not be written (the previous checkpoint, if any, is left as it was).
    """
    path = os.fspath(path)
    engine.flush_reports()  # this process's hand-outs and commits first: the cut includes them
    t0 = time.perf_counter()
    cut = engine.control.ledger.checkpoint_cut()
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        os.makedirs(tmp)
        state = cut["plane"]
        shards = write_shards(_media_once(_payloads(engine, state["live"])), os.path.join(tmp, "payloads-%06d.tar"),
                              maxcount=100_000, mtime=0.0)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        engine.control.ledger.checkpoint_done()
    try:
        reshape_part = state.get("reshape")
        current = reshape_part.get("layout") if isinstance(reshape_part, Mapping) else None
        # the fingerprint covers the ranks the plane has at the cut (after any live reshape of this pipeline)
        fp, parts = config_fingerprint({**state["config"], **({"layout": current} if current else {})})
        manifest = {
            "format": CHECKPOINT_FORMAT[0], "version": CHECKPOINT_FORMAT[1], "fingerprint": fp,
            "fingerprint_of": parts, "engine": engine.kind, "options": dict(options), "plane": state,
            "ledger": cut["ledger"], "reissue": cut["reissue"], "pause_ms": cut["pause_ms"],
            "payloads": {"shards": [os.path.basename(p) for p in shards], "count": len(state["live"])},
            "created_unix": time.time(),
        }
        mpath = os.path.join(tmp, "manifest.json")
        with open(mpath, "w", encoding="utf-8") as f:
            json.dump(manifest, f, separators=(",", ":"), allow_nan=False)
            f.flush()
            os.fsync(f.fileno())
        for p in shards:
            _fsync(p)
        nbytes = sum(os.path.getsize(p) for p in shards)
        old = None
        if os.path.exists(path):
            old = f"{path}.old-{uuid.uuid4().hex[:8]}"
            os.rename(path, old)
        os.rename(tmp, path)
        parent = os.path.dirname(os.path.abspath(path))
        _fsync(parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return CheckpointInfo(path=path, fingerprint=fp, trajectories=len(state["live"]), bytes=nbytes,
                          pause_ms=float(cut["pause_ms"]), write_s=time.perf_counter() - t0,
                          in_flight=len(cut["ledger"]["in_flight"]),
                          admitted_entries=sum(len(q) for q in state["queues"]))


# ------------------------------------------------------------------------------------------------ read
def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of the checkpoint directory ``path``, checked for its format.

    Raises:
        StateError: No checkpoint there, or one of another format.
    """
    mpath = os.path.join(os.fspath(path), "manifest.json")
    try:
        with open(mpath, encoding="utf-8") as f:
            m = json.load(f)
    except FileNotFoundError as e:
        raise StateError(f"no knitdata checkpoint at {os.fspath(path)!r} (no manifest.json)") from e
    except ValueError as e:
        raise StateError(f"checkpoint manifest {mpath!r} is not valid JSON: {e}") from e
    if not isinstance(m, dict) or (m.get("format"), m.get("version")) != CHECKPOINT_FORMAT:
        got = (m.get("format"), m.get("version")) if isinstance(m, dict) else type(m).__name__
        raise StateError(f"{mpath!r} is not a knitdata checkpoint of format {CHECKPOINT_FORMAT} (got {got})")
    for k in ("fingerprint", "plane", "ledger", "payloads", "options"):
        if k not in m:
            raise StateError(f"checkpoint manifest {mpath!r} lacks {k!r}")
    return m


def check_fingerprint(manifest: Mapping[str, Any], config: Mapping[str, Any], *,
                      allow_config_change: bool = False, ranks_may_differ: bool = False) -> bool:
    """Compare the checkpoint's configuration with the restoring pipeline's ``config``.

    Args:
        manifest: The checkpoint's manifest (:func:`read_manifest`).
        config: The restoring pipeline's configuration.
        allow_config_change: Accept another configuration (returns ``True`` then).
        ranks_may_differ: The number of ranks is a topology option here (a restore given the old ranks' states,
            which the elastic resume re-plans); every other key is still compared.

    Returns:
        Whether they differ (only possible with ``allow_config_change=True``).

    Raises:
        ConfigError: They differ (naming the keys) and ``allow_config_change`` is false, or the number of ranks
            differs and ``ranks_may_differ`` is false.
    """
    fp, parts = config_fingerprint(config)
    if fp == manifest["fingerprint"]:
        return False
    saved = manifest.get("fingerprint_of") or {}
    diff = sorted(k for k in set(parts) | set(saved) if parts.get(k) != saved.get(k))
    if "num_consumers" in diff:
        if not ranks_may_differ:
            raise ConfigError(
                f"the checkpoint was taken with {saved.get('num_consumers')} ranks, this pipeline has "
                f"{parts.get('num_consumers')}: to restore onto another number of ranks, pass the saved states of "
                "all old ranks to Pipeline.restore (rank_states=[state of rank 0, rank 1, ...], or one merged state "
                "from knitdata.merge_rank_states); or restore with the same number of ranks")
        diff.remove("num_consumers")
        if not diff:
            return False
    if not allow_config_change:
        raise ConfigError(
            f"the checkpoint's configuration fingerprint {manifest['fingerprint']} differs from this pipeline's "
            f"{fp} in {diff} (saved {[saved.get(k) for k in diff]}, now {[parts.get(k) for k in diff]}); restore "
            "with the same options, or pass allow_config_change=True to Pipeline.restore to continue anyway")
    return True


def saved_layout(manifest: Mapping[str, Any]) -> ConsumerLayout:
    """The layout the checkpointed plane's ranks had at the cut (after any earlier reshape of that pipeline).

    Raises:
        StateError: A manifest whose plane state names no valid layout.
    """
    plane = manifest["plane"]
    part = plane.get("reshape") if isinstance(plane, Mapping) else None
    try:
        raw = part["layout"] if isinstance(part, Mapping) and part.get("layout") is not None \
            else plane["config"]["layout"]
        return ConsumerLayout.from_dict(raw)
    except (KeyError, TypeError, ValueError, KnitdataError) as e:
        raise StateError(f"checkpoint manifest: no valid layout in its plane state ({type(e).__name__}: {e})") from e


def _unit_map(old: Mapping[str, str], new: Mapping[str, str]) -> dict[str, str]:
    """Old unit -> new unit: the new unit on the same node when there is one, else the new units in turn."""
    by_node = {node: u for u, node in new.items()}
    targets = list(new)
    out: dict[str, str] = {}
    k = 0
    for u, node in old.items():
        if node in by_node:
            out[u] = by_node[node]
        elif u in new:
            out[u] = u
        else:
            out[u] = targets[k % len(targets)]
            k += 1
    return out


def _relocate(x: Any, umap: Mapping[str, str]) -> None:
    """Replace, in place, the ``location`` of every trajectory metadata dict nested in ``x`` by its new unit."""
    if isinstance(x, dict):
        if isinstance(x.get("id"), str) and isinstance(x.get("location"), str) and x["location"] in umap:
            x["location"] = umap[x["location"]]
        for v in x.values():
            _relocate(v, umap)
    elif isinstance(x, list):
        for v in x:
            _relocate(v, umap)


def remap_plane_state(state: Mapping[str, Any], *, config: Mapping[str, Any], unit_nodes: Mapping[str, str],
                      ranks_may_differ: bool = False) -> tuple[dict[str, Any], dict[str, str]]:
    """A cut's plane state converted for a plane of ``config`` over the units ``unit_nodes``.

    Every plan, position and fingerprint is kept as it was (a restored pipeline hands out the same micro-batches
    as the original); each payload's unit becomes the new unit on its node, or, for a node that is gone, one of
    the new units in turn; the placement's accounting moves with it.

    Another number of ranks (``ranks_may_differ=True``): the state keeps its saved layout (the plane loads it as
    a plane reshaped onto that layout); the caller then applies the elastic resume onto ``config``'s layout
    (:meth:`knitdata.control.reshape.Reshaping.reshape`), as :func:`restore_into` does.

    Returns:
        ``(state, {old unit: new unit})``.

    Raises:
        ConfigError: Another number of ranks without ``ranks_may_differ``.
        StateError: A state without its layout (with ``ranks_may_differ``).
    """
    old_n = len(state["planned"])
    new_n = _num_consumers(config["layout"])
    if old_n != new_n and not ranks_may_differ:
        raise ConfigError(f"the checkpoint has {old_n} ranks, the restoring pipeline {new_n}: a restore onto another "
                          "number of ranks needs the elastic resume (pass the saved states of all old ranks to "
                          "Pipeline.restore as rank_states=...); or restore with the same number of ranks")
    if old_n != new_n and not (isinstance(state.get("reshape"), Mapping) and state["reshape"].get("layout")):
        raise StateError("the checkpoint's plane state does not name its layout: it cannot be restored onto another "
                         "number of ranks")
    umap = _unit_map(state["unit_nodes"], unit_nodes)
    out = json.loads(json.dumps(state))
    out["config"] = json.loads(json.dumps(dict(config)))
    out["unit_nodes"] = dict(unit_nodes)
    for key in ("live", "pending"):
        for m in out[key]:
            if m.get("location") is not None:
                m["location"] = umap[m["location"]]
    for q in out["queues"]:
        for e in q:
            for it in e["items"]:
                it[1] = umap[it[1]]
    _relocate(out["policy"], umap)  # the admission policy holds the metadata of what it has not admitted yet
    # the records of the queued mini-batches (their metadata), which a reshape plans again
    _relocate(out.get("reshape"), umap)
    out["recent_releases"] = []  # releases of the old units: nothing to send again here
    pl = out["placement"]
    if isinstance(pl, dict) and "load" in pl:
        load = dict.fromkeys(unit_nodes, 0)
        for u, v in pl["load"].items():
            load[umap[u]] += int(v)
        pl["load"] = load
        pl["groups"] = [[g, umap[u]] for g, u in pl["groups"]]
    return out, umap


def restore_into(engine: Any, path: str | os.PathLike[str], manifest: Mapping[str, Any], *,
                 config_changed: bool = False, put_timeout: float | None = 0.0,
                 merged: Mapping[str, Any] | None = None) -> RestoreReport:
    """Load the checkpoint at ``path`` into ``engine``, a fresh pipeline's engine (nothing put yet).

    The payloads go back into the units (the unit on their node, see :func:`remap_plane_state`), then the plane
    loads the cut's state and ledger. Onto another number of ranks (``merged`` given), the plane loads the cut in
    its saved layout, then continues on ``engine``'s layout from ``merged``
    (:meth:`knitdata.control.reshape.Reshaping.reshape`): what the old ranks were handed out before their states
    is never delivered again, the rest is planned for the new ranks.

    Args:
        engine: The fresh pipeline's engine.
        path: The checkpoint directory.
        manifest: Its manifest (:func:`read_manifest`).
        config_changed: Recorded in the report.
        put_timeout: Seconds a unit may wait for room while the payloads go back.
        merged: The merged state of all ranks the checkpoint's plane had (:func:`knitdata.merge_rank_states`):
            needed when ``engine`` has another number of ranks, applied whenever given.

    Raises:
        ConfigError: A unit cannot hold what it gets back (raise ``capacity_bytes`` or give a ``spill_dir``), or
            another number of ranks without ``merged``.
        StateError: The checkpoint's state does not load (damaged, or another configuration), or ``merged`` is
            not of the checkpoint's ranks (the elastic resume's refusals).
        CodecError: A damaged payload shard.
    """
    path = os.fspath(path)
    units = engine.units
    state, umap = remap_plane_state(manifest["plane"], config=engine.config, ranks_may_differ=merged is not None,
                                    unit_nodes={u: unit.node for u, unit in units.items()})
    where = {m["id"]: m["location"] for m in state["live"]}
    shards = [os.path.join(path, s) for s in manifest["payloads"]["shards"]]
    missing_files = [s for s in shards if not os.path.exists(s)]
    if missing_files:
        raise StateError(f"checkpoint {path!r}: payload shards {missing_files[:4]} are missing")
    batch: dict[str, list[Trajectory]] = {}
    n = 0

    def flush(u: str) -> None:
        trajs = batch.pop(u, [])
        if not trajs:
            return
        try:
            units[u].put_many(trajs, timeout=put_timeout)
        except StoreFull as e:
            raise ConfigError(f"restoring checkpoint {path!r}: storage unit {u!r} cannot hold the payloads it gets back "
                              f"({e}); restore with a larger capacity_bytes or a spill_dir") from e

    seen: set[str] = set()
    media: dict[str, MediaItem] = {}  # each media item once, whatever the number of payloads using it
    for traj in read_shards(shards if shards else []):
        traj = _resolve_media(traj, media, path)
        u = where.get(traj.id)
        if u is None or traj.id in seen:
            raise StateError(f"checkpoint {path!r}: payload {traj.id!r} is not held by its saved state (or twice)")
        seen.add(traj.id)
        batch.setdefault(u, []).append(traj)
        n += 1
        if len(batch[u]) >= _READ_CHUNK:
            flush(u)
    for u in list(batch):
        flush(u)
    lost = sorted(set(where) - seen)
    if lost:
        raise StateError(f"checkpoint {path!r}: {len(lost)} payloads of its saved state are not in its shards "
                         f"({lost[:8]})")
    try:
        engine.control.ledger.checkpoint_restore(state, manifest["ledger"])
    except KnitdataError as e:
        if isinstance(e, StateError):
            raise
        raise StateError(f"checkpoint {path!r} does not load: {e}") from e
    reshaped = None
    if merged is not None:
        old_n = len(state["planned"])
        res = engine.control.reshaping.reshape(dict(merged), engine.layout.to_dict())
        reshaped = {"from_ranks": old_n, "to_ranks": int(res["num_consumers"]), "replanned": int(res["replanned"]),
                    "segments": int(res["segments"])}
    reissue = [dict(r) for r in manifest.get("reissue", [])]
    return RestoreReport(path=path, trajectories=n, reissue=reissue, unit_map=umap, config_changed=config_changed,
                         merged_state=None if merged is None else dict(merged), reshaped=reshaped)


def restore_pipeline(
    cls: Any,
    path: str | os.PathLike[str],
    engine_of: Callable[[Any], Any],
    *,
    engine: str | None = None,
    layout: ConsumerLayout | None = None,
    rank_states: Sequence[Any] | Mapping[str, Any] | None = None,
    capacity_bytes: int | None = None,
    spill_dir: str | os.PathLike[str] | None = None,
    spill_bytes: int = 16 << 30,
    engine_options: Mapping[str, Any] | None = None,
    allow_config_change: bool = False,
    **options: Any,
) -> Any:
    """:meth:`knitdata.Pipeline.restore`: a new pipeline continuing the one checkpointed at ``path``.

    The saved options apply unless given. ``engine``, ``layout``, ``capacity_bytes``, ``spill_dir``,
    ``spill_bytes`` and ``engine_options`` change the topology only; any other keyword of
    :class:`~knitdata.Pipeline` (``token_budget``, ``admission``, ...) must keep the configuration's fingerprint
    unless ``allow_config_change=True``.

    The same number of ranks: plans and positions are those of the checkpoint; each rank loads its own saved
    state. Another number of ranks (a ``layout`` with more or fewer ranks): pass ``rank_states``, the saved
    states of **all** ranks the checkpointed pipeline had (or one merged state,
    :func:`knitdata.merge_rank_states`); the plane is restored in its saved layout and continued on ``layout``
    by the elastic resume, and every new rank loads ``pipe.restore_report.merged_state``. The producer reissues
    ``pipe.restore_report.reissue`` (:class:`RestoreReport`) either way.

    Args:
        cls: The pipeline class to build.
        path: The checkpoint directory.
        engine_of: Returns the engine of a pipeline of ``cls``.
        engine: The engine's name (default: the saved one).
        layout: Consumers by node (default: the saved one).
        rank_states: The old ranks' saved states (``ds.state_dict()`` or a ``StatefulDataLoader``'s state, one per
            rank, any order) or their merged state; required when ``layout`` has another number of ranks, ignored
            otherwise.
        capacity_bytes: Capacity of each unit (default: the saved one).
        spill_dir: Spill directory of the new units.
        spill_bytes: Their disk budget.
        engine_options: The new engine's options (Ray: ``name``, ``address``, ``nodes``...).
        allow_config_change: Continue although the configuration's fingerprint differs.
        **options: Other keywords of :class:`~knitdata.Pipeline`.

    Raises:
        StateError: No checkpoint at ``path``, a damaged one, or ``rank_states`` that are not the states of all
            its ranks (missing or duplicate ranks, another run, a position past what the checkpoint had planned
            for its rank or before what it had released).
        ConfigError: Another fingerprint (without ``allow_config_change``), another number of ranks without
            ``rank_states``, or units too small for the payloads they get back.
    """
    from knitdata.admission import BatchSpec
    from knitdata.control.rankstates import merge_rank_states

    manifest = read_manifest(path)
    cfg = manifest["plane"]["config"]
    saved = manifest["options"]
    old_layout = saved_layout(manifest)
    new_layout = layout if layout is not None else old_layout
    merged: dict[str, Any] | None = None
    if new_layout.num_consumers != old_layout.num_consumers:
        if rank_states is None:
            raise ConfigError(
                f"checkpoint {os.fspath(path)!r} was taken with {old_layout.num_consumers} ranks, the layout given has "
                f"{new_layout.num_consumers}: to restore onto another number of ranks, pass the saved states of all "
                f"{old_layout.num_consumers} old ranks: Pipeline.restore(path, layout=..., rank_states=[state of rank "
                "0, rank 1, ...]) (or rank_states=knitdata.merge_rank_states(states)); every new rank then loads "
                "pipe.restore_report.merged_state")
        merged = merge_rank_states([rank_states] if isinstance(rank_states, Mapping) else list(rank_states))
        if int(merged["num_consumers"]) != old_layout.num_consumers:
            raise StateError(f"rank_states are the states of a pipeline of {merged['num_consumers']} ranks, checkpoint "
                             f"{os.fspath(path)!r} was taken with {old_layout.num_consumers}: pass the states of its "
                             "ranks, saved with it")
    kwargs: dict[str, Any] = {
        "admission": cfg["admission"], "admission_options": cfg.get("admission_options") or {},
        "token_budget": cfg["token_budget"], "placement": cfg["placement"],
        "allow_split_groups": cfg["allow_split_groups"], "balance_tolerance": cfg["balance_tolerance"],
        "release": cfg["release"], "producer_timeout_s": cfg.get("producer_timeout_s"),
        "media_dedup": bool(cfg.get("media_dedup", True)),
        "put_timeout": saved.get("put_timeout", 60.0), "check_media": saved.get("check_media", True)}
    opts = dict(options)
    spec = opts.pop("spec", None)
    kwargs.update(opts)
    pipe = cls(spec if spec is not None else BatchSpec.from_dict(cfg["spec"]),
               layout=new_layout, engine=engine if engine is not None else str(manifest["engine"]),
               capacity_bytes=capacity_bytes if capacity_bytes is not None else int(saved["capacity_bytes"]),
               spill_dir=spill_dir, spill_bytes=spill_bytes, engine_options=engine_options, **kwargs)
    try:
        eng = engine_of(pipe)
        changed = check_fingerprint(manifest, eng.config, allow_config_change=allow_config_change,
                                    ranks_may_differ=merged is not None)
        pipe.restore_report = restore_into(eng, path, manifest, config_changed=changed, merged=merged)
    except BaseException:
        pipe.shutdown()
        raise
    return pipe


def lost_groups(engine: Any) -> dict[str, dict[str, Any]]:
    """The groups whose payloads are gone with a dead storage unit (Ray: its node died) and not in its spill.

    Returns:
        ``{group: {"trajectories": [lost ids], "admitted": bool, "ranks": [ranks whose planned micro-batches hold
        them], "units": [dead units]}}``; ``{}`` when every unit answers or everything is recoverable. A group not
        admitted yet can be regenerated (``pipe.withdraw(group)``, then put it again under a new group id); a
        consumer reaching an admitted lost group raises :class:`~knitdata.errors.TrajectoryLostError` naming its
        trajectories (restart from the last checkpoint).
    """
    from knitdata.storage.base import dead_units

    dead = dead_units(engine.units)
    if not dead:
        return {}
    report = engine.control.ledger.lost_on(dead)
    out: dict[str, dict[str, Any]] = {}
    for group, g in report["groups"].items():
        ids = list(g["trajectories"])
        back = set(engine.recoverable(dead, ids))
        ids = [t for t in ids if t not in back]
        if ids:
            out[group] = {"trajectories": ids, "admitted": bool(g["admitted"]), "ranks": list(g["ranks"]),
                          "units": dead}
    return out
