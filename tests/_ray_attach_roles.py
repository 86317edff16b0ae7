"""The processes of tests/test_ray_attach.py, each written the way README.md's Ray section tells a user to.

``python tests/_ray_attach_roles.py ROLE ARGS...`` (started with a clean environment: PATH, HOME and PYTHONPATH):

* ``creator NAME...``: creates one Ray-engine pipeline per name (``engine_options={"name": NAME}``, which starts
  a local Ray), prints ``{"address"}`` (``knitdata.ray_address()``) and stays alive until stdin closes.
* ``producer NAME ADDRESS N``: attaches, puts ``N`` trajectories (groups of 2), closes the pipeline.
* ``trickle NAME ADDRESS``: attaches and puts one trajectory every 0.2 s until a put raises.
* ``rank NAME ADDRESS RANK``: attaches and iterates ``pipe.dataset(RANK)`` to the end.
* ``paused_attach NAME ADDRESS WHERE``: ``Pipeline.attach`` stopped inside, right before its lookup of the pipeline
  (``WHERE="get_actor"``) or its first call to the coordinator (``"info"``): prints ``{"paused": WHERE}`` and
  goes on when a line arrives on stdin (so that the test can kill the creator while the process is inside attach).

Every role prints JSON lines: ``{"attached": seconds}`` once attached, ``{"ids": [...]}`` per micro-batch (ranks),
and at the end ``{"done": ...}`` or ``{"error": class name, "message": ..., "t": time.time()}``.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

#: The pipelines' shape: two consumers, 2 mini-batches of 4 trajectories (2 groups of 2) per train batch.
GROUP_SIZE = 2
PER_TRAIN_BATCH = 8


def _say(**kw: Any) -> None:
    print(json.dumps(kw), flush=True)


def _traj(i: int) -> Any:
    import torch

    from knitdata import Trajectory

    return Trajectory(id=f"t{i}", source="math", group=f"g{i // GROUP_SIZE}", gen_version=0,
                      prompt_ids=torch.arange(4), response_ids=torch.arange(4 + i % 5), scalars={"reward": float(i)})


def creator(names: list[str]) -> None:
    import knitdata
    from knitdata import BatchSpec, Pipeline

    spec = BatchSpec({"math": PER_TRAIN_BATCH}, num_minibatches=2, group_size=GROUP_SIZE)
    pipes = [Pipeline(spec, num_consumers=2, engine="ray", engine_options={"name": n}) for n in names]
    _say(address=knitdata.ray_address())
    sys.stdin.read()  # until the test closes stdin (or kills this process)
    for p in pipes:
        p.shutdown()


def producer(name: str, address: str, n: int) -> None:
    from knitdata import Pipeline

    t0 = time.perf_counter()
    pipe = Pipeline.attach(name, address=address)
    _say(attached=time.perf_counter() - t0)
    try:
        for i in range(n):
            pipe.put(_traj(i))
    finally:
        pipe.close()
    _say(done=n)


def trickle(name: str, address: str) -> None:
    from knitdata import Pipeline

    pipe = Pipeline.attach(name, address=address)
    _say(attached=True)
    i = 0
    try:
        while True:
            pipe.put(_traj(i))
            i += 1
            time.sleep(0.2)
    except Exception as e:  # noqa: BLE001 - reported to the test
        _say(error=type(e).__name__, message=str(e), t=time.time(), put=i)


def rank(name: str, address: str, r: int) -> None:
    from knitdata import Pipeline

    t0 = time.perf_counter()
    try:
        pipe = Pipeline.attach(name, address=address)
        _say(attached=time.perf_counter() - t0)
        n = 0
        for mb in pipe.dataset(r, fetch="iter"):
            _say(ids=list(mb.info.trajectory_ids))
            n += 1
        _say(done=n)
    except Exception as e:  # noqa: BLE001 - reported to the test
        _say(error=type(e).__name__, message=str(e), t=time.time(), after=time.perf_counter() - t0)


def paused_attach(name: str, address: str, where: str) -> None:
    import ray

    from knitdata import Pipeline
    from knitdata.engines.ray.control import RayControl

    def pause() -> None:
        _say(paused=where)
        sys.stdin.readline()

    if where == "get_actor":
        real_get_actor = ray.get_actor

        def get_actor(*args: Any, **kwargs: Any) -> Any:
            pause()
            return real_get_actor(*args, **kwargs)

        ray.get_actor = get_actor
    else:
        real_bind = RayControl.bind

        def bind(self: Any, call: Any) -> Any:  # the function the proxies call for `call`
            made = real_bind(self, call)
            if call.name != where:
                return made

            def paused_call(*args: Any, **kwargs: Any) -> Any:
                pause()
                return made(*args, **kwargs)

            return paused_call

        RayControl.bind = bind  # type: ignore[method-assign]
    t0 = time.perf_counter()
    try:
        Pipeline.attach(name, address=address)
        _say(attached=time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001 - reported to the test
        _say(error=type(e).__name__, message=str(e), t=time.time(), after=time.perf_counter() - t0)


def main(argv: list[str]) -> None:
    role, args = argv[0], argv[1:]
    if role == "creator":
        creator(args)
    elif role == "producer":
        producer(args[0], args[1], int(args[2]))
    elif role == "trickle":
        trickle(args[0], args[1])
    elif role == "rank":
        rank(args[0], args[1], int(args[2]))
    elif role == "paused_attach":
        paused_attach(args[0], args[1], args[2])
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
