"""The transferqueue baseline: transferqueue's controller and storage units on loopback, and its clients as
step sources (synchronous as verl drives it, an async client working ahead, its streaming loader)."""

from __future__ import annotations

import functools
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from benchmarks.common.consumer import StepItem
from benchmarks.common.engines import LoopbackError, RayCluster
from benchmarks.common.models import VLMConfig, preprocess
from benchmarks.common.workload import TransferWorkload, make_step_groups, trajectory_id
from knitdata.errors import EngineError
from knitdata.record import MediaItem, Trajectory

__all__ = ["TQServer", "TQSource", "TQAsyncSource", "TQLoaderSource"]


_TQ_PARTITION = "knitdata_bench"


def _tq_fields(w: TransferWorkload) -> list[str]:
    """transferqueue row fields of the workload (every row holds its own copy of the media)."""
    if w.workload == "omni":
        return ["input_ids", "video" if w.video_container else "frames", "audio", "tidx"]
    return ["input_ids", "pixel_values", "tidx"]


def _tq_partition(rank: int) -> str:
    """The partition of consumer ``rank``: its share of every step, in training order."""
    return f"{_TQ_PARTITION}_r{rank}"


def _tq_id(w: TransferWorkload, idx: int) -> str:
    per_step = w.groups_per_step * w.group_size
    return trajectory_id(idx // per_step, (idx // w.group_size) % w.groups_per_step, idx % w.group_size)


def _is_loopback(ip: str) -> bool:
    return ip == "::1" or ip == "localhost" or ip.startswith("127.")


class TQServer:
    """The real transferqueue: Ray on loopback, controller + SimpleStorage units, the workload put once.

    Each consumer rank reads its own partition (its share of every step, in order); every source reads it
    under its own ``task_name``, so the rows are put once and each source consumes all of them.
    """

    def __init__(self, w: TransferWorkload, num_units: int = 2):
        self.w = w
        self.num_units = num_units
        self.conf: Any = None
        self.addresses: dict[str, str] = {}
        self.startup_s = 0.0
        self.put_s = 0.0

    def start(self, cluster: RayCluster) -> None:
        """Start the controller and storage units on ``cluster`` (Ray on loopback) and check their addresses."""
        t0 = time.perf_counter()
        os.environ["TQ_NUM_THREADS"] = "1"
        import ray

        cluster.start()
        node_ips = sorted({n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")})
        self.addresses["ray_nodes"] = ",".join(node_ips)
        if not all(_is_loopback(ip) for ip in node_ips):
            raise LoopbackError(f"Ray nodes on {node_ips}, not loopback; refusing to run transferqueue here")
        import transfer_queue as tq

        self.conf = tq.init({"controller": {"polling_mode": True},
                             "backend": {"SimpleStorage": {"num_data_storage_units": self.num_units}}})
        ctl = self.conf.controller.zmq_info
        self.addresses["controller"] = f"{ctl.ip}:{sorted(ctl.ports.values())}"
        for name, info in self.conf.backend.SimpleStorage.zmq_info.items():
            self.addresses[str(name)] = f"{info.ip}:{sorted(info.ports.values())}"
        ips = [ctl.ip] + [info.ip for info in self.conf.backend.SimpleStorage.zmq_info.values()]
        if not all(_is_loopback(ip) for ip in ips):
            raise LoopbackError(
                f"transferqueue listens on {sorted(set(ips))}, not loopback only; refusing to run. Set "
                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before Ray starts"
            )
        self.startup_s = time.perf_counter() - t0

    def put_all(self, progress: Any = None) -> set[str]:
        """Put every trajectory of the run as sample-level rows (each row holds its own media copy) into the
        partition of the rank that trains on it."""
        import numpy as np
        import transfer_queue as tq
        from tensordict import TensorDict

        client = tq.get_client()
        w = self.w
        t0 = time.perf_counter()
        ids: set[str] = set()
        idx = 0
        groups_per_rank = w.per_consumer_step // w.group_size
        for step in range(w.total_steps):
            for g, group in enumerate(make_step_groups(w, step)):
                n = len(group)
                fields: dict[str, torch.Tensor] = {
                    "input_ids": torch.stack([torch.cat([t.prompt_ids, t.response_ids]) for t in group]),
                    "tidx": torch.arange(idx, idx + n, dtype=torch.int64),
                }
                if w.workload == "omni" and w.video_container:  # the MP4 container's bytes, decoded by consumers
                    video = next(m for m in group[0].media if m.kind == "video")
                    audio = next(m for m in group[0].media if m.kind == "audio")
                    assert video.data is not None and audio.data is not None
                    for name, data in (("video", video.data), ("audio", audio.data)):
                        raw = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())
                        fields[name] = raw.unsqueeze(0).expand(n, -1).contiguous()
                elif w.workload == "omni":
                    frames = [m.tensor for m in group[0].media if m.kind == "image" and m.tensor is not None]
                    audio = next(m for m in group[0].media if m.kind == "audio")
                    assert audio.data is not None
                    fields["frames"] = torch.stack(frames).unsqueeze(0).expand(n, *([-1] * 4)).contiguous()
                    clip = torch.from_numpy(np.frombuffer(audio.data, dtype=np.uint8).copy())
                    fields["audio"] = clip.unsqueeze(0).expand(n, -1).contiguous()
                else:
                    img = group[0].media[0].tensor
                    assert img is not None
                    fields["pixel_values"] = img.unsqueeze(0).expand(n, *img.shape).contiguous()
                client.put(TensorDict(fields, batch_size=n), partition_id=_tq_partition(g // groups_per_rank))
                for t in group:
                    assert _tq_id(w, idx) == t.id
                    ids.add(t.id)
                    idx += 1
            if progress is not None:
                progress.update(1)
        self.put_s = time.perf_counter() - t0
        torch.set_num_threads(1)
        return ids

    def close(self) -> None:
        """Stop transferqueue's client, controller and storage units (Ray stays up for the next modes)."""
        if self.conf is not None:
            import transfer_queue as tq

            tq.close()
            self.conf = None


def _unbind(t: torch.Tensor) -> list[torch.Tensor]:
    return list(t.unbind()) if t.is_nested else list(t)


class _TQDecode:
    """Turn transferqueue micro-batches (TensorDicts) into what the trainer consumes (picklable: it also runs in
    the streaming loader's worker processes).

    ``dup``: per kind the encoder inputs of every row (each row's media processed, audio decoded from its FLAC
    bytes with soundfile); ``shared``: a step's micro-batches become trajectories whose media a
    :class:`~knitdata.media.multimodal.MultimodalCollator` (provenance keys) collates once per unique item.
    """

    def __init__(self, w: TransferWorkload, cfg: VLMConfig):
        self.w = w
        self.cfg = cfg
        self._proc: Any = None
        self._coll: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {"w": self.w, "cfg": self.cfg, "_proc": None, "_coll": None}

    def _rows(self, td: Any) -> tuple[list[int], torch.Tensor, list[list[MediaItem]], int]:
        w = self.w
        tidx_t = td["tidx"]
        tidx = [int(x) for x in (torch.cat(_unbind(tidx_t)) if tidx_t.is_nested else tidx_t.reshape(-1))]
        ids_t = td["input_ids"]
        input_ids = torch.stack(_unbind(ids_t)) if ids_t.is_nested else ids_t
        moved = input_ids.numel() * 8 + len(tidx) * 8
        media: list[list[MediaItem]] = []
        if w.workload == "omni" and w.video_container:
            for i, v, c in zip(tidx, _unbind(td["video"]), _unbind(td["audio"])):
                gid = _tq_id(w, i).rsplit("t", 1)[0]
                media.append([MediaItem("video", data=v.numpy().tobytes(), digest=f"{gid}/v"),
                              MediaItem("audio", data=c.numpy().tobytes(), sample_rate=w.audio_rate,
                                        digest=f"{gid}/a")])
                moved += v.numel() + c.numel()
        elif w.workload == "omni":
            frames, clips = _unbind(td["frames"]), _unbind(td["audio"])
            for i, f, c in zip(tidx, frames, clips):
                gid = _tq_id(w, i).rsplit("t", 1)[0]
                f = f.reshape(w.video_frames, *w.item_shape)
                items = [MediaItem("image", tensor=f[j], digest=f"{gid}/{j}") for j in range(w.video_frames)]
                items.append(MediaItem("audio", data=c.numpy().tobytes(), sample_rate=w.audio_rate,
                                       digest=f"{gid}/a"))
                media.append(items)
                moved += f.numel() + c.numel()
        else:
            for i, im in zip(tidx, _unbind(td["pixel_values"])):
                gid = _tq_id(w, i).rsplit("t", 1)[0]
                media.append([MediaItem("image", tensor=im.reshape(w.image_shape), digest=f"{gid}/0")])
                moved += im.numel()
        return tidx, input_ids, media, moved

    def dup(self, td: Any, index: int, k: int) -> StepItem:
        """One micro-batch with every row's own media processed (``dup`` encoding)."""
        if self._proc is None:
            from knitdata.media.process import MediaProcessor

            self._proc = MediaProcessor(preprocess(self.w, self.cfg))
        tidx, input_ids, media, moved = self._rows(td)
        per: dict[str, list[torch.Tensor]] = {kd: [] for kd in self.w.media_kinds}
        for i, items in zip(tidx, media):
            for j, item in enumerate(items):
                per[item.kind].append(self._proc.process(item, trajectory_id=_tq_id(self.w, i), index=j).tensor)
        inputs = {kd: torch.cat(v) for kd, v in per.items()}
        nbytes = input_ids.numel() * input_ids.element_size() + sum(v.numel() * v.element_size()
                                                                    for v in inputs.values())
        return StepItem(tuple(_tq_id(self.w, i) for i in tidx), input_ids, inputs, None, index, k, index == k - 1,
                     nbytes, moved)

    def shared(self, tds: Sequence[Any]) -> list[StepItem]:
        """A step's micro-batches with one :class:`~knitdata.media.multimodal.MultimodalBatch` (``shared``)."""
        if self._coll is None:
            from knitdata.media.multimodal import MultimodalCollator

            self._coll = MultimodalCollator(preprocess(self.w, self.cfg), key="provenance")
        w = self.w
        p = w.prompt_tokens
        mbs: list[list[Trajectory]] = []
        rows = []
        for td in tds:
            tidx, input_ids, media, moved = self._rows(td)
            trajs = [Trajectory(id=_tq_id(w, i), source="mm", group=_tq_id(w, i).rsplit("t", 1)[0],
                                prompt_ids=ids[:p], response_ids=ids[p:], media=items)
                     for i, ids, items in zip(tidx, input_ids, media)]
            mbs.append(trajs)
            rows.append((tidx, input_ids, moved))
        batch = self._coll(mbs)
        k = len(tds)
        out = []
        for i, (tidx, input_ids, moved) in enumerate(rows):
            nbytes = input_ids.numel() * input_ids.element_size() + (int(batch.nbytes) if i == 0 else 0)
            out.append(StepItem(tuple(_tq_id(w, t) for t in tidx), input_ids, None, batch, i, k, i == k - 1, nbytes,
                             moved))
        return out


class TQSource:
    """transferqueue as verl drives it: one consumer's synchronous client, ``get_meta`` (polling) + ``get_data``
    per micro-batch in the trainer thread, rows processed there."""

    def __init__(self, conf: Any, rank: int, w: TransferWorkload, cfg: VLMConfig, task: str = "train",
                 poll_timeout_s: float = 60.0):
        os.environ["TQ_NUM_THREADS"] = "1"
        from transfer_queue.client import TransferQueueClient

        self.client = TransferQueueClient(client_id=f"knitdata_bench_{task}_{rank}_{os.getpid()}",
                                          controller_info=conf.controller.zmq_info)
        self.client.initialize_storage_manager(manager_type="SimpleStorage", config=conf.backend.SimpleStorage)
        self.w = w
        self.task = task
        self.partition = _tq_partition(rank)
        self.decode = _TQDecode(w, cfg)
        self.poll_timeout_s = poll_timeout_s
        self.i = 0
        self.last_wait = 0.0
        torch.set_num_threads(1)

    def get(self) -> Any:
        """One micro-batch's rows (polls until ``microbatch_size`` rows are ready)."""
        b = self.w.microbatch_size
        deadline = time.monotonic() + self.poll_timeout_s
        while True:
            meta = self.client.get_meta(data_fields=_tq_fields(self.w), batch_size=b, partition_id=self.partition,
                                        task_name=self.task)
            if len(meta) == b:
                break
            if time.monotonic() > deadline:
                raise EngineError(f"transferqueue delivered no micro-batch of {b} within {self.poll_timeout_s} s "
                                  f"(partition {self.partition}, task {self.task})")
            time.sleep(0.001)
        return self.client.get_data(meta)

    def fetch(self) -> StepItem:
        """The next micro-batch, fetched and processed on the trainer's thread (``last_wait``: all of it)."""
        t0 = time.perf_counter()
        k = self.w.microbatches_per_step
        item = self.decode.dup(self.get(), self.i % k, k)
        self.i += 1
        self.last_wait = time.perf_counter() - t0
        return item

    def close(self) -> None:
        self.client.close()


class TQAsyncSource:
    """transferqueue at its best, (a): its asyncio client (``AsyncTransferQueueClient``) in a background thread
    that fetches and processes micro-batches ahead of the trainer.

    ``dup``: up to ``ahead`` processed micro-batches wait in the queue (plus one being fetched); ``shared``: the
    unit is a step (its ``K`` micro-batches and their media batch, needed at micro-batch 0), one step ahead.
    The thread stops after the run's last micro-batch; errors reach the trainer at its next ``next()``.
    """

    def __init__(self, conf: Any, rank: int, w: TransferWorkload, cfg: VLMConfig, encoding: str, task: str,
                 ahead: int = 2, poll_timeout_s: float = 60.0):
        self.conf, self.rank, self.w, self.encoding, self.task = conf, rank, w, encoding, task
        self.decode = _TQDecode(w, cfg)
        self.poll_timeout_s = poll_timeout_s
        self.q: queue.Queue = queue.Queue(maxsize=ahead if encoding == "dup" else 1)
        self.buf: list[StepItem] = []
        self.last_wait = 0.0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"tq-prefetch-{task}-{rank}", daemon=True)
        self.thread.start()

    def _put(self, x: Any) -> bool:
        while not self._stop.is_set():
            try:
                self.q.put(x, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        import asyncio

        torch.set_num_threads(1)
        try:
            asyncio.run(self._main())
        except BaseException as e:  # handed to the trainer
            self._put(e)

    async def _main(self) -> None:
        import asyncio

        from transfer_queue.client import AsyncTransferQueueClient

        w = self.w
        client = AsyncTransferQueueClient(f"knitdata_bench_{self.task}_{self.rank}_{os.getpid()}",
                                          self.conf.controller.zmq_info)
        client.initialize_storage_manager(manager_type="SimpleStorage", config=self.conf.backend.SimpleStorage)
        part, b, k = _tq_partition(self.rank), w.microbatch_size, w.microbatches_per_step
        try:
            pending: list[Any] = []
            for i in range(w.total_steps * k):
                deadline = time.monotonic() + self.poll_timeout_s
                while True:
                    meta = await client.async_get_meta(data_fields=_tq_fields(w), batch_size=b, partition_id=part,
                                                       task_name=self.task)
                    if len(meta) == b:
                        break
                    if time.monotonic() > deadline:
                        raise EngineError(f"transferqueue delivered no micro-batch of {b} within "
                                          f"{self.poll_timeout_s} s (partition {part}, task {self.task})")
                    await asyncio.sleep(0.001)
                td = await client.async_get_data(meta)
                if self.encoding == "dup":
                    if not self._put(self.decode.dup(td, i % k, k)):
                        return
                else:
                    pending.append(td)
                    if len(pending) == k:
                        bundle, pending = self.decode.shared(pending), []
                        if not self._put(bundle):
                            return
        finally:
            client.close()

    def fetch(self) -> StepItem:
        """The next micro-batch; ``last_wait`` is the time blocked on the queue for it."""
        self.last_wait = 0.0
        if not self.buf:
            t0 = time.perf_counter()
            x = self.q.get(timeout=self.poll_timeout_s * 2)
            self.last_wait = time.perf_counter() - t0
            if isinstance(x, BaseException):
                raise x
            self.buf = [x] if isinstance(x, StepItem) else list(x)
        return self.buf.pop(0)

    def close(self) -> None:
        self._stop.set()
        self.thread.join(timeout=10)


def _tq_collate(decode: _TQDecode, encoding: str, k: int) -> Callable[[Any], Any]:
    return functools.partial(_tq_loader_collate, decode, encoding, k)


def _tq_loader_collate(decode: _TQDecode, encoding: str, k: int, data: Any) -> Any:
    """The streaming loader's ``collate_fn`` (runs in its workers): process rows like the other sources."""
    td, meta = data
    if encoding == "dup":
        return [decode.dup(td, 0, k)]
    # shared: the dataset yields the whole step (one batch of K micro-batches); split it here
    b = decode.w.microbatch_size
    n = td.batch_size[0]
    return decode.shared([td[i:i + b] for i in range(0, n, b)])


def _tq_whole_batch(td: Any, batch_meta: Any, micro_batch_size: int = 1) -> list[tuple[Any, Any]]:
    """``process_batch_fn`` of the streaming dataset in ``shared`` mode: yield the step's batch whole."""
    return [(td, batch_meta)]


class TQLoaderSource:
    """transferqueue at its best, (b): its own ``StreamingDataset`` + ``StreamingDataLoader`` as its documentation
    recommends (``num_workers`` loader processes, each with its own client, ``prefetch_factor`` batches ahead);
    each worker fetches a step's share (``batch_size`` = the rank's trajectories per step) and processes it in
    its ``collate_fn``. Workers are started (spawn) when the source is built, before the measured steps."""

    def __init__(self, conf: Any, rank: int, w: TransferWorkload, cfg: VLMConfig, encoding: str, task: str,
                 num_workers: int = 1, prefetch_factor: int = 2):
        from transfer_queue.dataloader import StreamingDataLoader, StreamingDataset

        self.w = w
        k = w.microbatches_per_step
        ds = StreamingDataset(config=conf, batch_size=w.per_consumer_step, micro_batch_size=w.microbatch_size,
                              data_fields=_tq_fields(w), partition_id=_tq_partition(rank), task_name=task,
                              dp_rank=rank, process_batch_fn=None if encoding == "dup" else _tq_whole_batch)
        self.loader = StreamingDataLoader(ds, num_workers=num_workers,
                                          prefetch_factor=prefetch_factor if num_workers else None,
                                          collate_fn=_tq_collate(_TQDecode(w, cfg), encoding, k),
                                          multiprocessing_context="spawn" if num_workers else None,
                                          persistent_workers=False)
        self.it: Any = iter(self.loader)
        self.buf: list[StepItem] = []
        self.i = 0
        self.last_wait = 0.0

    def fetch(self) -> StepItem:
        """The next micro-batch; ``last_wait`` is the time inside the loader's ``next()`` for it."""
        self.last_wait = 0.0
        if not self.buf:
            t0 = time.perf_counter()
            self.buf = list(next(self.it))
            self.last_wait = time.perf_counter() - t0
        item = self.buf.pop(0)
        k = self.w.microbatches_per_step
        if item.media is None:  # dup: the workers see one micro-batch at a time; number it here
            item.index, item.is_last = self.i % k, self.i % k == k - 1
        self.i += 1
        return item

    def close(self) -> None:
        self.it = None  # the DataLoader iterator stops its workers when it is collected
        import gc

        gc.collect()
