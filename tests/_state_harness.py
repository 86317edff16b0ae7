"""One save/load check for every stateful class of knitdata, after torchdata's ``run_test_save_load_state``.

torchdata (``test/nodes/utils.py``) runs a loader to a midpoint, takes ``state_dict()``, finishes the epoch,
then loads the midpoint state and checks that what follows equals the rest of the uninterrupted run (and
the next epoch, and a restart from the initial and the end-of-epoch states). The same here, with two
differences that knitdata's contract asks for:

- every state is JSON: it must hold only JSON types (no tensors, bytes or objects that would need pickle),
  and it is loaded from ``json.loads(json.dumps(state))``, as a checkpoint file gives it back;
- it is loaded into a *fresh* instance (``make()``), as a restarted process would, never into the one
  that saved it.

Two forms:

- :func:`run_test_save_load_state` for a stateful *iterable* (``ShardDataset``, a ``StatefulDataLoader``
  over it, a ``TrajectoryDataset``, the Accelerate loader);
- :func:`run_test_save_load_steps` for a stateful *object* driven by calls (admission policies,
  ``Placement``, ``VersionClock``): each step is a call whose result is compared.

Each test module draws the midpoints (with hypothesis where it fits) and calls one of them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

__all__ = ["json_state", "run_test_save_load_state", "run_test_save_load_steps"]

_JSON_LEAVES = (str, int, float, bool, type(None))


def _check_json(value: Any, path: str) -> None:
    if isinstance(value, _JSON_LEAVES):
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_json(v, f"{path}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            assert isinstance(k, str), f"state key {path}.{k!r} is a {type(k).__name__}, not a JSON string"
            _check_json(v, f"{path}.{k}")
        return
    raise AssertionError(f"state value {path} is a {type(value).__name__}: not JSON (it would need pickle)")


def json_state(obj: Any, *, only: Callable[[Any], Any] | None = None) -> Any:
    """Take ``obj.state_dict()``, check it is JSON (``only`` picks the part to check), and return it as a file
    gives it back (``json.loads(json.dumps(...))``; a state that is not JSON as a whole is returned as is)."""
    state = obj.state_dict()
    _check_json(state if only is None else only(state), "state")
    if only is not None:
        return state
    text = json.dumps(state, allow_nan=False)
    return json.loads(text)


def _take(it: Iterator[Any], n: int, key: Callable[[Any], Any]) -> list[Any]:
    out = []
    for _ in range(n):
        out.append(key(next(it)))
    return out


def _close(*things: Any) -> None:
    """Close iterators and instances (a wrapper's dataset too: its prefetch thread ends with it)."""
    for t in things:
        for obj in (t, getattr(t, "dataset", None)):
            close = getattr(obj, "close", None)
            if close is not None:
                close()


def run_test_save_load_state(
    make: Callable[[], Any],
    midpoints: Iterable[int],
    *,
    key: Callable[[Any], Any] = lambda x: x,
    epochs: int = 1,
    end_of_epoch: str | None = None,
    only: Callable[[Any], Any] | None = None,
    reads_back: bool = True,
) -> list[list[Any]]:
    """Check that a stateful iterable resumes exactly from states taken at ``midpoints``.

    Args:
        make: Builds a fresh instance (with its data: shards, a fed pipeline...), the same every call.
        midpoints: Items taken before ``state_dict()`` (``0`` ... the epoch's length).
        key: Maps an item to what is compared (an id tuple, a tensor's list...).
        epochs: ``1`` (a stream that ends: ``TrajectoryDataset``) or ``2``: the epoch after a resumed one, and
            after one resumed at a midpoint of the second epoch, is checked too.
        end_of_epoch: With ``epochs=2``, what a state taken after the first epoch's last item gives on a fresh
            instance: ``"empty"`` (torchdata.nodes without restart: one empty pass, then the next epoch) or
            ``"next"`` (the next epoch at once); ``None`` skips the check.
        only: Picks the part of the state that must be JSON (for a wrapper whose own state is not all JSON;
            the knitdata states inside it must be).
        reads_back: Check that ``state_dict()`` right after ``load_state_dict(state)`` gives ``state`` back
            (off for ``StatefulDataLoader``, which applies a loaded state when iteration starts).

    Returns:
        The uninterrupted run, one list of keys per epoch (non-empty: a check over nothing proves nothing).
    """
    ref_obj = make()
    initial = json_state(ref_obj, only=only)
    ref = [[key(x) for x in ref_obj] for _ in range(epochs)]
    _close(ref_obj)
    assert ref[0], "the reference run yields nothing: the check would pass vacuously"

    start = make()
    start.load_state_dict(initial)
    assert [key(x) for x in start] == ref[0], "a fresh instance loaded with the initial state"
    _close(start)

    for m in midpoints:
        assert 0 <= m <= len(ref[0]), f"midpoint {m} outside 0..{len(ref[0])}"
        x = make()
        it = iter(x)
        head = _take(it, m, key)
        state = json_state(x, only=only)
        assert head == ref[0][:m], f"midpoint {m}: the run before saving differs from the reference"
        _close(it, x)
        y = make()
        y.load_state_dict(state)
        if reads_back:
            assert json_state(y, only=only) == state, f"midpoint {m}: a loaded state does not read back the same"
        tail = [key(v) for v in y]
        assert head + tail == ref[0], f"midpoint {m}: resumed {len(tail)} items, the reference has {len(ref[0]) - m}"
        if epochs > 1:
            assert [key(v) for v in y] == ref[1], f"midpoint {m}: the epoch after the resumed one differs"
        _close(y)
        if epochs > 1 and m > 0:  # the same midpoint of the second epoch (0 there is the end-of-epoch state)
            x = make()
            assert [key(v) for v in x] == ref[0]
            it = iter(x)
            head = _take(it, m, key)
            state = json_state(x, only=only)
            _close(it, x)
            y = make()
            y.load_state_dict(state)
            assert head + [key(v) for v in y] == ref[1], f"midpoint {m} of epoch 1"
            _close(y)

    if epochs > 1 and end_of_epoch is not None:
        x = make()
        assert [key(v) for v in x] == ref[0]
        state = json_state(x, only=only)
        _close(x)
        y = make()
        y.load_state_dict(state)
        if end_of_epoch == "empty":
            assert [key(v) for v in y] == [], "an end-of-epoch state: the pass after loading it is empty"
        assert [key(v) for v in y] == ref[1], "an end-of-epoch state: then the next epoch"
        _close(y)
    return ref


def run_test_save_load_steps(
    make: Callable[[], Any],
    steps: Sequence[Callable[[Any], Any]],
    midpoints: Iterable[int],
) -> list[Any]:
    """Check that a stateful object driven by ``steps`` continues exactly from states taken between steps.

    The reference runs every step on one instance. For each midpoint ``m`` a second instance runs the first
    ``m`` steps, saves its (JSON) state, a fresh instance loads it and runs the rest: the step results must
    equal the reference's, and so must the final state.

    Args:
        make: Builds a fresh instance.
        steps: Calls ``step(obj) -> result`` (results compared with ``==``; return ``None`` for a pure action).
        midpoints: Steps run before saving (``0`` ... ``len(steps)``).

    Returns:
        The reference results.
    """
    a = make()
    ref = [step(a) for step in steps]
    final = json_state(a)
    assert any(r not in (None, [], (), {}) for r in ref), "no step returns anything: the check would be vacuous"
    for m in midpoints:
        assert 0 <= m <= len(steps), f"midpoint {m} outside 0..{len(steps)}"
        b = make()
        got = [step(b) for step in steps[:m]]
        state = json_state(b)
        c = make()
        c.load_state_dict(state)
        assert json_state(c) == state, f"midpoint {m}: a loaded state does not read back the same"
        got += [step(c) for step in steps[m:]]
        assert got == ref, f"midpoint {m}: the resumed run differs from the reference"
        assert json_state(c) == final, f"midpoint {m}: the final state differs from the reference's"
    return ref
