"""Structure fuzzing of knitdata's own headers: mutate a decoded JSON header at any path.

Used by the structure fuzzes of tests/test_codec.py, tests/test_spill.py and tests/test_shards.py: they
decode a valid header, mutate it here, re-frame it with correct lengths and checksums, and check that
decoding yields a valid trajectory or a ``KnitdataError``, never anything else.
"""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import strategies as st

DTYPE_NAMES = [
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "bytes", "complex64", "object", "",
]

#: Values of other types and shapes put where a header value was.
WEIRD = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, -1, 2, 63, 64, 65, 2**31, 2**32, 2**62, 2**63, 2**64, 10**30, -(2**63)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.sampled_from(DTYPE_NAMES + ["image", "audio", "video", "trajectory", "tensor", "json", "prompt_ids"]),
    st.lists(st.integers(-3, 2**40), max_size=4),
    st.lists(st.one_of(st.none(), st.text(max_size=3), st.floats()), max_size=3),
    st.lists(st.lists(st.integers(0, 3), max_size=2), max_size=2),
    st.dictionaries(st.text(max_size=4), st.integers(-2, 5) | st.text(max_size=3), max_size=3),
)


def paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path (tuple of keys/indices) to a value inside ``obj``, the root excluded."""
    out: list[tuple] = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.append((*prefix, k))
            out.extend(paths(v, (*prefix, k)))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.append((*prefix, i))
            out.extend(paths(v, (*prefix, i)))
    return out


def _parent(obj: Any, path: tuple) -> Any:
    for k in path[:-1]:
        obj = obj[k]
    return obj


def mutate(data: Any, header: dict, *, max_mutations: int = 3, protect: tuple = ()) -> tuple[dict, list[str]]:
    """Apply 1..``max_mutations`` random structural mutations to a deep copy of ``header``.

    Args:
        data: Hypothesis ``st.data()`` object.
        header: The decoded header.
        max_mutations: Most mutations applied.
        protect: Top-level keys left alone (e.g. a checksum field the re-framing recomputes).

    Returns:
        ``(mutated header, descriptions of the mutations)``.
    """
    h = copy.deepcopy(header)
    done: list[str] = []
    for _ in range(data.draw(st.integers(1, max_mutations))):
        ps = [p for p in paths(h) if p[0] not in protect]
        action = data.draw(st.sampled_from(["replace", "replace", "delete", "add", "dtype"]))
        if action == "dtype":
            ps_dt = [p for p in ps if p[-1] == "dtype"]
            if ps_dt:
                p = data.draw(st.sampled_from(ps_dt))
                new = data.draw(st.sampled_from(DTYPE_NAMES))
                _parent(h, p)[p[-1]] = new
                done.append(f"dtype {p} = {new!r}")
                continue
            action = "replace"
        if action == "add":
            dicts = [()] + [p for p in ps if isinstance(_parent(h, p + ("x",)), dict)]
            p = data.draw(st.sampled_from(dicts))
            target = _parent(h, p + ("x",))
            key = data.draw(st.sampled_from(["x", "meta", "buffers", "t/x", "m/9", "members", "fields"]) | st.text(max_size=4))
            target[key] = data.draw(WEIRD)
            done.append(f"add {p + (key,)}")
            continue
        if not ps:
            continue
        p = data.draw(st.sampled_from(ps))
        parent = _parent(h, p)
        if action == "delete":
            del parent[p[-1]]
            done.append(f"delete {p}")
        else:
            new = data.draw(WEIRD)
            parent[p[-1]] = new
            done.append(f"replace {p} = {new!r:.60}")
    return h, done
