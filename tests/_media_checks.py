"""Media reference-count checks shared by the engines' tests (issue 43): a media workload and the exact-count
assertions made after every scenario of the conformance suite's media run (``tests/_conformance.py``,
``media_counts``), on the embedded engine and on Ray.

* :func:`media_workload`: groups whose first member carries the group's image and the others refer to it
  (:meth:`MediaItem.ref <knitdata.record.MediaItem.ref>`), each trajectory with its own audio clip, and one
  "screenshot" that every trajectory shares (the first one put carries it: on a multi-node layout the other
  units resolve it from the unit that holds it).
* :func:`media_report`: per unit, :meth:`StorageUnit.media_check <knitdata.storage.base.StorageUnit.media_check>`
  plus the unit's byte counters, as JSON.
* :func:`check_media_exact`: raise ``AssertionError`` unless every unit's counts are exact (sum of references ==
  (trajectory, media) pairs held, bytes == distinct bytes, nothing leaked), and with ``empty=True`` unless
  nothing at all is held (0 bytes, 0 items, 0 references).
"""

from __future__ import annotations

from typing import Any

__all__ = ["MEDIA_PER_TRAJ", "media_workload", "media_report", "check_media_exact", "held_totals"]

#: Media items per trajectory of :func:`media_workload`: the group's image, its own audio, the shared screenshot.
MEDIA_PER_TRAJ = 3
_IMG = (3, 16, 16)  # 768 bytes
_SHOT = (3, 24, 24)  # 1728 bytes
_AUDIO = 64  # float32: 256 bytes


def _image(seed: int, shape: tuple[int, ...]) -> Any:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)


def media_workload(n_groups: int, group_size: int = 4, *, refs: bool = True, sources: tuple[str, ...] = ("math", "code"),
                   tokens: int = 24, first: int = 0) -> list[Any]:
    """Trajectories ``t<first>...`` in ``n_groups`` groups of ``group_size`` over ``sources`` (alternating by group).

    Args:
        refs: Later users of an item put a reference (``False``: every trajectory carries the content).
        first: Index of the first trajectory (ids and contents follow from it).
    """
    import torch

    from knitdata.record import MediaItem, Trajectory

    shot = MediaItem("image", tensor=_image(10_000_019, _SHOT))
    out = []
    for g in range(n_groups):
        img = MediaItem("image", tensor=_image(1_000 + g + first * 7919, _IMG))
        for k in range(group_size):
            i = first + g * group_size + k
            gen = torch.Generator().manual_seed(i)
            audio = MediaItem("audio", tensor=torch.rand(_AUDIO, generator=gen), sample_rate=16000)
            lead = k == 0
            media = [img if lead or not refs else MediaItem.ref("image", img.digest), audio,
                     shot if (i == first and g == 0) or not refs else MediaItem.ref("image", shot.digest)]
            out.append(Trajectory(
                id=f"t{i}", source=sources[g % len(sources)], group=f"g{first}_{g}", gen_version=0,
                prompt_ids=torch.randint(0, 1000, (8,), generator=gen),
                response_ids=torch.randint(0, 1000, (tokens - 8,), generator=gen),
                scalars={"reward": float(i)}, media=media))
    return out


def media_report(pipe: Any) -> dict[str, Any]:
    """``{unit id: media_check() + used_bytes, num_items, spilled_items, media_* stats}`` of ``pipe``'s units."""
    out = {}
    for uid, unit in pipe.internals.units.items():
        st = unit.stats()
        rep = dict(unit.media_check())
        rep.update(used_bytes=st.used_bytes, num_items=st.num_items, spilled_items=st.spilled_items,
                   media_items=st.media_items, media_bytes=st.media_bytes, media_refs=st.media_refs,
                   media_bytes_saved=st.media_bytes_saved, media_copied_in=st.media_copied_in)
        out[str(uid)] = rep
    return out


def held_totals(report: dict[str, Any]) -> dict[str, int]:
    """Sums over the units of a :func:`media_report`: used_bytes, media_items, media_bytes, media_refs, pairs."""
    keys = ("used_bytes", "media_items", "media_bytes", "media_refs", "pairs", "num_items", "spilled_items")
    return {k: sum(int(r[k]) for r in report.values()) for k in keys}


def check_media_exact(report: dict[str, Any], *, empty: bool = False, where: str = "") -> None:
    """Assert a :func:`media_report` is exact on every unit (and, with ``empty``, that nothing is held)."""
    for uid, r in report.items():
        tag = f"{where}: unit {uid}: {r}"
        assert r["ok"], tag
        assert r["pairs"] == r["refs"] == r["media_refs"], tag
        assert r["bytes"] == r["distinct_bytes"] == r["media_bytes"], tag
        assert not r["leaked"], tag
        assert r["media_bytes"] <= r["used_bytes"], tag  # spilled payloads keep their media in memory
        if empty:
            assert r["used_bytes"] == 0 and r["media_items"] == 0 and r["media_refs"] == 0, tag
            assert r["num_items"] == 0 and r["spilled_items"] == 0, tag
