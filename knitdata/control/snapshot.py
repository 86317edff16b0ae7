"""Checking a control-plane snapshot before it is loaded (:meth:`knitdata.control.ControlPlane.load_state_dict`).

A snapshot is JSON that the plane wrote itself, but it is read back from disk: :func:`decode_snapshot` checks
its whole structure (types, ranges, units, ranks, the configuration it belongs to) and converts it, so that a
crafted or damaged snapshot with a valid checksum gets a :class:`~knitdata.errors.StateError`, never a
``TypeError`` or ``KeyError`` later.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from knitdata import errors
from knitdata.control.records import ItemRef, PlanEntry
from knitdata.control.state import Replicas
from knitdata.errors import KnitdataError, StateError
from knitdata.planner import MicroBatchInfo
from knitdata.record import TrajectoryMeta

__all__ = ["decode_snapshot", "SNAPSHOT_KEYS", "SNAPSHOT_KEYS_V1", "SNAPSHOT_KEYS_V3", "ERROR_TYPES"]

#: The keys of a snapshot of format 1.
SNAPSHOT_KEYS_V1: frozenset[str] = frozenset({
    "format", "config", "unit_nodes", "policy", "placement", "seq", "putting", "schema", "withdrawn", "delivered", "live",
    "put_tokens", "pending", "loss", "queues", "planned", "committed", "position", "closed", "close_report", "error", "version",
    "staleness", "counts", "rejected_by_cause", "recent_releases",
})
#: The keys of a snapshot (format 2: format 1 and the replay fingerprints).
SNAPSHOT_KEYS: frozenset[str] = SNAPSHOT_KEYS_V1 | {"chains", "fps", "verify_at"}
#: The keys of a snapshot of format 3: format 2 and the reshape part (:mod:`knitdata.control.reshape`).
SNAPSHOT_KEYS_V3: frozenset[str] = SNAPSHOT_KEYS | {"reshape"}
#: The error classes a stopped plane's error may be restored as (their constructor takes the message alone).
ERROR_TYPES: dict[str, type[KnitdataError]] = {
    c.__name__: c for c in (errors.KnitdataError, errors.QuotaInfeasibleError, errors.ValidationError,
                            errors.FieldTypeError, errors.StateError, errors.ConfigError, errors.CodecError,
                            errors.EngineError, errors.PipelineClosedError, errors.IncompleteStreamError,
                            errors.DataTimeoutError, errors.StoreFull)
}


def _bad(where: str, want: str, got: Any) -> StateError:
    return StateError(f"control-plane snapshot: {where} must be {want}, got {str(got)[:120]}")


def _int(x: Any, where: str, lo: int = 0) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < lo:
        raise _bad(where, f"an int >= {lo}", x)
    return x


def _str(x: Any, where: str) -> str:
    if not isinstance(x, str):
        raise _bad(where, "a string", x)
    return x


def _list(x: Any, where: str) -> list[Any]:
    if not isinstance(x, list):
        raise _bad(where, "a list", x)
    return x


def _dict(x: Any, where: str) -> dict[str, Any]:
    if not isinstance(x, dict) or not all(isinstance(k, str) for k in x):
        raise _bad(where, "an object", x)
    return x


def _is_unit(x: Any, units: Mapping[str, str]) -> bool:
    return isinstance(x, str) and x in units


def _ints(x: Any, where: str, n: int | None = None, lo: int = 0) -> list[int]:
    xs = _list(x, where)
    if n is not None and len(xs) != n:
        raise _bad(where, f"a list of {n} ints", x)
    return [_int(v, f"{where}[{i}]", lo) for i, v in enumerate(xs)]


def _meta(x: Any, where: str, units: Mapping[str, str], located: bool) -> TrajectoryMeta:
    d = _dict(x, where)
    if not isinstance(d.get("id"), str) or not isinstance(d.get("source"), str) or not isinstance(d.get("group"), str):
        raise _bad(where, "trajectory metadata (id, source, group strings)", x)
    try:
        m = TrajectoryMeta.from_dict(d)
    except KnitdataError as e:
        raise StateError(f"control-plane snapshot: {where}: {e}") from e
    if located and not _is_unit(m.location, units):
        raise _bad(f"{where}.location", f"a storage unit of {sorted(units)}", m.location)
    if not located and m.location is not None:
        raise _bad(f"{where}.location", "null (a put in progress)", m.location)
    return m


def _fields(x: Any, where: str) -> dict[str, Any] | None:
    if x is None:
        return None
    d = _dict(x, where)
    sc, te = d.get("scalars"), d.get("tensors")
    if (set(d) != {"scalars", "tensors"} or not isinstance(sc, list) or not all(isinstance(v, str) for v in sc)
            or not isinstance(te, dict) or not all(isinstance(v, str) for v in te.values())):
        raise _bad(where, "{'scalars': [str], 'tensors': {str: str}}", x)
    return {"scalars": list(sc), "tensors": dict(te)}


def _digest(x: Any, where: str) -> str | None:
    if x is None:
        return None
    if not isinstance(x, str) or len(x) != 16 or any(c not in "0123456789abcdef" for c in x):
        raise _bad(where, "a fingerprint (16 hex digits) or null", x)
    return x


def _entry(x: Any, where: str, rank: int, units: Mapping[str, str], fmt: int) -> PlanEntry:
    e = _dict(x, where)
    keys = {"j", "minibatch", "microbatch", "info", "items"} | ({"fp"} if fmt >= 2 else set())
    if set(e) != keys:
        raise _bad(where, f"a micro-batch entry {{{', '.join(sorted(keys))}}}", x)
    j = _int(e["j"], f"{where}.j")
    mb = _int(e["minibatch"], f"{where}.minibatch")
    mi = _int(e["microbatch"], f"{where}.microbatch")
    info = _dict(e["info"], f"{where}.info")
    try:
        parsed = MicroBatchInfo.from_dict(info)
    except KnitdataError as err:
        raise StateError(f"control-plane snapshot: {where}.info: {err}") from err
    if parsed.to_dict() != info or parsed.consumer != rank or parsed.minibatch != mb or parsed.microbatch != mi:
        raise _bad(f"{where}.info", f"micro-batch info of rank {rank}, mini-batch {mb}, micro-batch {mi}", info)
    items = []
    for k, it in enumerate(_list(e["items"], f"{where}.items")):
        w = f"{where}.items[{k}]"
        if not isinstance(it, list) or len(it) != 3:
            raise _bad(w, "[trajectory id, unit, bytes]", it)
        if not _is_unit(it[1], units):
            raise _bad(f"{w}[1]", f"a storage unit of {sorted(units)}", it[1])
        items.append(ItemRef(_str(it[0], f"{w}[0]"), it[1], _int(it[2], f"{w}[2]")))
    return PlanEntry(j, mb, mi, parsed, items, _digest(e.get("fp"), f"{where}.fp"))


def _close_report(x: Any, where: str) -> dict[str, Any] | None:
    if x is None:
        return None
    r = _dict(x, where)
    want = {"dropped_trajectories", "dropped_groups", "by_source", "in_progress", "group_members", "group_size"}
    if set(r) != want:
        raise _bad(where, f"a close report with keys {sorted(want)}", x)
    _int(r["dropped_trajectories"], f"{where}.dropped_trajectories")
    for k in ("dropped_groups", "in_progress"):
        if not all(isinstance(v, str) for v in _list(r[k], f"{where}.{k}")):
            raise _bad(f"{where}.{k}", "a list of strings", r[k])
    for k in ("by_source", "group_members"):
        for s, v in _dict(r[k], f"{where}.{k}").items():
            _int(v, f"{where}.{k}.{s}")
    _int(r["group_size"], f"{where}.group_size", 1)
    return r


def _json_equal(a: Any, b: Any) -> bool:
    try:
        return bool(json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True))
    except (TypeError, ValueError):
        return False


def _putting(x: Any, units: Mapping[str, str]) -> list[tuple[str, str, TrajectoryMeta, dict[str, Any] | None]]:
    """Puts in progress of the removed two-phase put (checked; a plane refuses a state holding any)."""
    putting = []
    for k, p in enumerate(_list(x, "putting")):
        w = f"putting[{k}]"
        if not isinstance(p, list) or len(p) != 4:
            raise _bad(w, "[trajectory id, unit, metadata, fields]", p)
        tid = _str(p[0], f"{w}[0]")
        if not _is_unit(p[1], units):
            raise _bad(f"{w}[1]", f"a storage unit of {sorted(units)}", p[1])
        m = _meta(p[2], f"{w}[2]", units, located=False)
        if m.id != tid:
            raise _bad(f"{w}[2].id", repr(tid), m.id)
        putting.append((tid, p[1], m, _fields(p[3], f"{w}[3]")))
    return putting


def _queues(x: Any, units: Mapping[str, str], fmt: int, committed: list[int],
            planned: list[int]) -> list[list[PlanEntry]]:
    queues = []
    for r, q in enumerate(_list(x, "queues")):
        entries = [_entry(e, f"queues[{r}][{k}]", r, units, fmt) for k, e in enumerate(_list(q, f"queues[{r}]"))]
        js = [e.j for e in entries]
        if js != sorted(set(js)) or any(not committed[r] <= j < planned[r] for j in js):
            raise _bad(f"queues[{r}]", f"entries in increasing order within committed..planned "
                       f"({committed[r]}..{planned[r]})", js)
        queues.append(entries)
    if len(queues) != len(planned):
        raise _bad("queues", f"a list of {len(planned)} queues (one per rank)", len(queues))
    return queues


def _error(err: Any) -> KnitdataError | None:
    if err is None:
        return None
    e = _dict(err, "error")
    if set(e) != {"type", "message"} or not isinstance(e["type"], str) or e["type"] not in ERROR_TYPES \
            or not isinstance(e["message"], str):
        raise _bad("error", f"{{'type': one of {sorted(ERROR_TYPES)}, 'message': str}}", err)
    return ERROR_TYPES[e["type"]](e["message"])


def _releases(x: Any, units: Mapping[str, str]) -> list[tuple[str, list[str]]]:
    rel = []
    for k, r in enumerate(_list(x, "recent_releases")):
        w = f"recent_releases[{k}]"
        if not isinstance(r, list) or len(r) != 2 or not _is_unit(r[0], units) or not isinstance(r[1], list) \
                or not all(isinstance(i, str) for i in r[1]):
            raise _bad(w, f"[unit of {sorted(units)}, [trajectory ids]]", r)
        rel.append((r[0], list(r[1])))
    return rel


def _fingerprints(s: Mapping[str, Any], n: int) -> dict[str, Any]:
    """The replay fingerprints of a format-2 snapshot: ``chains``, ``fps`` and ``verify_at``, one per rank."""
    chains = [_digest(x, f"chains[{r}]") for r, x in enumerate(_list(s["chains"], "chains"))]
    fps_all = _list(s["fps"], "fps")
    if len(chains) != n or len(fps_all) != n:
        raise _bad("chains/fps", f"one per rank ({n})", [len(chains), len(fps_all)])
    fps = []
    for r, pairs in enumerate(fps_all):
        d: dict[int, str | None] = {}
        for k, pair in enumerate(_list(pairs, f"fps[{r}]")):
            if not isinstance(pair, list) or len(pair) != 2:
                raise _bad(f"fps[{r}][{k}]", "[length, fingerprint]", pair)
            length = _int(pair[0], f"fps[{r}][{k}][0]")
            if d and length <= max(d):
                raise _bad(f"fps[{r}]", "increasing lengths", pairs)
            d[length] = _digest(pair[1], f"fps[{r}][{k}][1]")
        fps.append(d)
    verify: list[tuple[int, str, str] | None] = []
    for r, v in enumerate(_list(s["verify_at"], "verify_at")):
        if v is None:
            verify.append(None)
            continue
        if not isinstance(v, list) or len(v) != 3:
            raise _bad(f"verify_at[{r}]", "[length, fingerprint, where] or null", v)
        fp = _digest(v[1], f"verify_at[{r}][1]")
        if fp is None:
            raise _bad(f"verify_at[{r}][1]", "a fingerprint", v[1])
        verify.append((_int(v[0], f"verify_at[{r}][0]"), fp, _str(v[2], f"verify_at[{r}][2]")))
    if len(verify) != n:
        raise _bad("verify_at", f"one per rank ({n})", len(verify))
    return {"chains": chains, "fps": fps, "verify_at": verify}


def decode_snapshot(state: Any, *, config: Mapping[str, Any], unit_nodes: Mapping[str, str], num_consumers: int,
                    counts: Mapping[str, int]) -> dict[str, Any]:
    """Check a snapshot against the plane that loads it and convert its parts.

    Args:
        state: The snapshot (:meth:`~knitdata.control.ControlPlane.state_dict`).
        config: The loading plane's configuration (the snapshot's must be the same).
        unit_nodes: The loading plane's units (the snapshot's must be the same).
        num_consumers: Ranks of the loading plane's layout.
        counts: The loading plane's counters (the snapshot holds the same names).

    Returns:
        The snapshot's parts, checked: metadata as :class:`~knitdata.record.TrajectoryMeta`, the error as an
        exception; ``policy`` and ``placement`` are passed on to their own loaders (which check them).

    Raises:
        StateError: Anything malformed, or a snapshot of another configuration or set of units.
    """
    s = _dict(state, "the snapshot")
    fmt = s.get("format")
    if fmt not in (1, 2, 3) or isinstance(fmt, bool):
        raise _bad("format", "1, 2 or 3", fmt)
    keys = SNAPSHOT_KEYS_V3 if fmt == 3 else SNAPSHOT_KEYS if fmt == 2 else SNAPSHOT_KEYS_V1
    if fmt >= 2 and "replicas" in s:  # optional: a pipeline whose ranks registered replicas
        keys = keys | {"replicas"}
    if set(s) != keys:
        raise StateError(f"control-plane snapshot: keys {sorted(s)} are not those of format {fmt} (missing "
                         f"{sorted(keys - set(s))}, unexpected {sorted(set(s) - keys)})")
    if not _json_equal(s["config"], dict(config)):
        raise StateError("control-plane snapshot: it was taken of a pipeline with another configuration (batch "
                         "spec, layout or options); load it into a plane built with the same ones")
    if not _json_equal(s["unit_nodes"], dict(unit_nodes)):
        raise StateError(f"control-plane snapshot: its storage units {str(s['unit_nodes'])[:200]} are not this "
                         f"plane's {dict(unit_nodes)}")
    units = dict(unit_nodes)
    n = num_consumers
    out: dict[str, Any] = {"policy": _dict(s["policy"], "policy"), "placement": _dict(s["placement"], "placement")}
    out["seq"] = _int(s["seq"], "seq")
    out["putting"] = _putting(s["putting"], units)
    out["schema"] = _fields(s["schema"], "schema")
    out["withdrawn"] = [_str(g, f"withdrawn[{k}]") for k, g in enumerate(_list(s["withdrawn"], "withdrawn"))]
    out["delivered"] = [_str(t, f"delivered[{k}]") for k, t in enumerate(_list(s["delivered"], "delivered"))]
    out["live"] = [_meta(m, f"live[{k}]", units, located=True) for k, m in enumerate(_list(s["live"], "live"))]
    tokens = _dict(s["put_tokens"], "put_tokens")
    if not all(isinstance(v, str) for v in tokens.values()):
        raise _bad("put_tokens", "{trajectory id: token string}", tokens)
    out["put_tokens"] = dict(tokens)
    out["pending"] = [_meta(m, f"pending[{k}]", units, located=True)
                      for k, m in enumerate(_list(s["pending"], "pending"))]
    out["loss"] = {tid: _int(v, f"loss.{tid}") for tid, v in _dict(s["loss"], "loss").items()}
    out["planned"] = _ints(s["planned"], "planned", n)
    out["committed"] = _ints(s["committed"], "committed", n)
    out["position"] = _ints(s["position"], "position", n)
    out["queues"] = _queues(s["queues"], units, fmt, out["committed"], out["planned"])
    if not isinstance(s["closed"], bool):
        raise _bad("closed", "a bool", s["closed"])
    out["closed"] = s["closed"]
    out["close_report"] = _close_report(s["close_report"], "close_report")
    out["error"] = _error(s["error"])
    out["version"] = _int(s["version"], "version")
    out["staleness"] = _ints(s["staleness"], "staleness", lo=-(1 << 62))
    c = _dict(s["counts"], "counts")
    if fmt == 1:  # counters added since
        c = {"version_rollbacks": 0, **c}
    if set(c) != set(counts):
        raise _bad("counts", f"counters {sorted(counts)}", sorted(c))
    out["counts"] = {k: _int(v, f"counts.{k}", lo=-(1 << 62)) for k, v in c.items()}
    out["rejected_by_cause"] = {k: _int(v, f"rejected_by_cause.{k}")
                                for k, v in _dict(s["rejected_by_cause"], "rejected_by_cause").items()}
    out["recent_releases"] = _releases(s["recent_releases"], units)
    if fmt == 1:  # no fingerprints: states of this run cannot be checked against a refill
        out["chains"] = [None] * n
        out["fps"] = [{} for _ in range(n)]
        out["verify_at"] = [None] * n
        return out
    out.update(_fingerprints(s, n))
    if "replicas" in s:
        out["replicas"] = _replicas(s["replicas"], n, out["committed"], out["planned"])
    return out


def _replicas(x: Any, n: int, committed: list[int], planned: list[int]) -> Replicas:
    """The ``replicas`` part (:class:`~knitdata.control.state.Replicas`), checked against the ranks' positions."""
    d = _dict(x, "replicas")
    if set(d) != {"num", "committed", "position", "handed"}:
        raise _bad("replicas", "an object with num, committed, position and handed", sorted(d))
    num = _int(d["num"], "replicas.num", lo=1)
    rows: dict[str, list[list[int]]] = {}
    for key in ("committed", "position"):
        xs = _list(d[key], f"replicas.{key}")
        if len(xs) != n:
            raise _bad(f"replicas.{key}", f"a list of {n} lists", xs)
        rows[key] = [_ints(r, f"replicas.{key}[{i}]", num) for i, r in enumerate(xs)]
    for r in range(n):
        if min(rows["committed"][r]) > committed[r]:
            raise _bad(f"replicas.committed[{r}]", f"replica positions whose smallest is at most rank {r}'s "
                       f"committed position {committed[r]}", rows["committed"][r])
    handed = _list(d["handed"], "replicas.handed")
    if len(handed) != n:
        raise _bad("replicas.handed", f"a list of {n} lists", handed)
    masks: list[dict[int, int]] = []
    for r, h in enumerate(handed):
        pairs = [_ints(p, f"replicas.handed[{r}][{k}]", 2) for k, p in enumerate(_list(h, f"replicas.handed[{r}]"))]
        if any(not committed[r] <= j < planned[r] or not 0 < m < (1 << num) for j, m in pairs):
            raise _bad(f"replicas.handed[{r}]", f"[entry, mask] pairs of entries {committed[r]}..{planned[r]}", h)
        masks.append({j: m for j, m in pairs})
    return Replicas(num, rows["committed"], rows["position"], masks)
