"""Multimodal requests: the raw media of a prompt become :class:`~knitdata.record.MediaItem` s and the prompt
carries one placeholder token per item, as knitdata's multimodal collate expects.

An engine serving a vision-language or audio model takes the raw media (a ``PIL.Image``, an ``uint8`` pixel
array, encoded bytes, an audio array with its sampling rate) and expands each item's placeholder in the prompt
into as many tokens as the encoder makes rows (vLLM's ``prompt_token_ids`` hold the expanded prompt). knitdata
keeps the media themselves (shared encoding encodes each unique item once per mini-batch, with the model's own
processor at collate time: its metadata such as ``image_grid_thw`` is computed there, and audio keeps its sampling
rate in the item) and *one* placeholder per item in ``prompt_ids``, expanded again by the collate
(:meth:`knitdata.integrations.hf_adapter.HFMultimodalAdapter.collate`). :func:`attach_media` does both: it builds
the items (:func:`knitdata.media.process.image_item`, :func:`knitdata.media.process.audio_item`) and collapses each run of a
placeholder token into one, checking that the prompt holds one run per item of each kind. Items of one kind that
follow each other without a token between them cannot be told apart this way (Qwen models put vision start/end
tokens around each image): such a prompt is refused.

The collate expands each placeholder to the number of rows the *trainer's* processor makes. When the engine's
processor expanded an item to another number (another resize, another patch or merge size, another audio frame
rate), re-expanding would shift every later position: pass ``expected_rows`` (e.g.
:meth:`knitdata.integrations.hf_adapter.HFMultimodalAdapter.placeholder_rows`) and :func:`attach_media` checks each
run of the engine's prompt against it, refusing a mismatch with the trajectory, the media index and both counts.

Example:
    >>> import numpy as np
    >>> s = RolloutSample("v1", 0, prompt_ids=[1, 122, 120, 120, 120, 123, 7], response_ids=[5], logprobs=[-1.0],
    ...                   version=0)
    >>> img = np.zeros((8, 8, 3), dtype=np.uint8)                # H, W, C pixels (or a PIL image, PNG bytes)
    >>> s = attach_media(s, [img], placeholder_ids={"image": 120})
    >>> s.prompt_ids.tolist(), [m.kind for m in s.media]
    ([1, 122, 120, 123, 7], ['image'])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from knitdata.errors import MediaError, RolloutOutputError
from knitdata.media.process import audio_item, image_item
from knitdata.record import MEDIA_KINDS, MediaItem
from knitdata.rollout.sample import RolloutGroup, RolloutSample

__all__ = ["media_item", "collapse_placeholders", "attach_media"]

T = TypeVar("T", RolloutSample, RolloutGroup)


def media_item(raw: Any, *, request_id: str | None = None, index: int | None = None) -> MediaItem:
    """Build a media item from raw media as a rollout harness holds them.

    Args:
        raw: A :class:`~knitdata.record.MediaItem` (kept: a video comes as :func:`knitdata.video_item` made it); audio as ``(samples, sampling_rate)`` or a dict with
            ``"array"`` and ``"sampling_rate"`` (the Hugging Face ``datasets`` audio format); anything else is an
            image: a ``PIL.Image``, ``uint8`` pixels (``[H, W, C]``, ``[C, H, W]`` or ``[H, W]``), encoded bytes or
            a file path.
        request_id: Named in errors.
        index: The item's index, named in errors.

    Raises:
        RolloutOutputError: The item cannot be read (the message says why).
    """
    try:
        if isinstance(raw, MediaItem):
            return raw
        if isinstance(raw, Mapping) and "array" in raw:
            return audio_item(raw["array"], sample_rate=int(raw["sampling_rate"]))
        if isinstance(raw, tuple) and len(raw) == 2 and isinstance(raw[1], int):
            return audio_item(raw[0], sample_rate=raw[1])
        return image_item(raw)
    except (MediaError, KeyError, TypeError, ValueError) as e:
        raise RolloutOutputError(f"media item {index}: {e}", request_id=request_id, field="media") from e


def collapse_placeholders(prompt_ids: torch.Tensor, placeholder_id: int) -> tuple[torch.Tensor, int]:
    """Collapse each run of ``placeholder_id`` in ``prompt_ids`` into one token.

    Returns:
        ``(collapsed prompt, number of runs)``.
    """
    out, lengths = _collapse(prompt_ids, placeholder_id)
    return out, len(lengths)


def _collapse(prompt_ids: torch.Tensor, placeholder_id: int) -> tuple[torch.Tensor, list[int]]:
    """``(collapsed prompt, length of each run in prompt order)``."""
    ids = prompt_ids.tolist()
    out: list[int] = []
    lengths: list[int] = []
    for i, tok in enumerate(ids):
        if tok == placeholder_id:
            if i and ids[i - 1] == placeholder_id:
                lengths[-1] += 1
                continue
            lengths.append(1)
        out.append(tok)
    return torch.tensor(out, dtype=prompt_ids.dtype), lengths


def attach_media(target: T, media: Sequence[Any], *, placeholder_ids: Mapping[str, int],
                 expected_rows: Callable[[MediaItem], int] | None = None, references: bool = False) -> T:
    """Return the sample (or every sample of the group) with its prompt's media attached.

    Args:
        target: A :class:`~knitdata.rollout.sample.RolloutSample` or a
            :class:`~knitdata.rollout.sample.RolloutGroup` (its samples share the prompt and its media: the same
            items, so shared encoding finds them by provenance or digest).
        media: The prompt's raw media, in prompt order (see :func:`media_item`).
        placeholder_ids: The model's placeholder token per kind (:data:`knitdata.record.MEDIA_KINDS`), e.g.
            ``{"image": image_token_id}``; every item's kind needs one.
        expected_rows: The number of placeholder tokens the trainer's processor expands an item to (what the
            collate will expand it to again), e.g. ``adapter.placeholder_rows``; each run in the engine's prompt
            must be that long. ``None``: run lengths are not checked (an engine whose processor differs from the
            trainer's then shifts the positions silently).
        references: For a group: every sample after the first carries references to the first's items
            (:meth:`~knitdata.record.MediaItem.ref`: digests, no content), so the group's media are put once; put
            the group's trajectories in order (``put_many``). The pipeline stores one copy per digest either way;
            references save sending the content again (across processes). Refused with
            :class:`~knitdata.errors.MediaRefError` at ``put`` when the first sample's items are not held.

    Raises:
        RolloutOutputError: An unreadable item, an unknown kind in ``placeholder_ids``, a prompt whose runs of a
            placeholder do not match the number of items of that kind, or (with ``expected_rows``) a run whose
            length differs from what the trainer's processor makes for its item (naming the trajectory, the
            media index and both counts).
    """
    rid = target.request_id
    items = [media_item(m, request_id=rid, index=i) for i, m in enumerate(media)]
    for kind in placeholder_ids:
        if kind not in MEDIA_KINDS:
            raise RolloutOutputError(f"unknown media kind {kind!r} in placeholder_ids (known: {MEDIA_KINDS})",
                                     request_id=rid, field="media")
    for i, m in enumerate(items):
        if m.kind not in placeholder_ids:
            raise RolloutOutputError(f"media item {i} is {m.kind!r} but placeholder_ids names no {m.kind} placeholder",
                                     request_id=rid, field="media")

    rows: list[int] | None = None
    if expected_rows is not None:
        rows = []
        for i, m in enumerate(items):
            try:
                rows.append(int(expected_rows(m)))
            except (MediaError, KeyError, TypeError, ValueError) as e:
                raise RolloutOutputError(f"media item {i}: the trainer's processor cannot take it ({e})",
                                         request_id=rid, field="media") from e

    def one(s: RolloutSample) -> RolloutSample:
        prompt = s.prompt_ids
        for kind, pid in placeholder_ids.items():
            prompt, lengths = _collapse(prompt, int(pid))
            of_kind = [i for i, m in enumerate(items) if m.kind == kind]
            if len(lengths) != len(of_kind):
                raise RolloutOutputError(
                    f"the prompt holds {len(lengths)} run(s) of the {kind} placeholder {pid} for {len(of_kind)} "
                    f"{kind} item(s)",
                    request_id=rid, sample=s.index, field="prompt_ids",
                )
            for i, got in zip(of_kind, lengths):
                if rows is not None and got != rows[i]:
                    raise RolloutOutputError(
                        f"trajectory {s.trajectory_id!r}: media item {i} ({kind}) was expanded by the engine to {got} "
                        f"placeholder tokens but the trainer's processor makes {rows[i]}: re-expanded to {rows[i]}, "
                        "every later position would shift; give the engine and the trainer the same processor "
                        "settings (resize, patch and merge size, audio frame rate)",
                        request_id=rid, sample=s.index, field="prompt_ids",
                    )
        return dataclasses.replace(s, prompt_ids=prompt, media=list(items))

    if isinstance(target, RolloutGroup):
        samples: list[RolloutSample] = [one(s) for s in target.samples]
        if references:
            refs: list[MediaItem] = [MediaItem.ref(m.kind, m.digest, sample_rate=m.sample_rate) for m in items]
            samples[1:] = [dataclasses.replace(s, media=list(refs)) for s in samples[1:]]
        return RolloutGroup(rid, samples)  # type: ignore[return-value]
    return one(target)  # type: ignore[return-value]
