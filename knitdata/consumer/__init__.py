"""The consumer side: what runs in the trainer's process, from the plan to the micro-batch the trainer holds.

One module per stage of a micro-batch's path:

* :mod:`knitdata.consumer.dataset`: :class:`~knitdata.consumer.dataset.TrajectoryDataset`, one per rank, and its JSON
  state;
* :mod:`knitdata.consumer.session`: the dataset's session with the control plane and its stages (plan, read,
  collate, media, metrics);
* :mod:`knitdata.consumer.fetch`: the fetch modes ``sample`` / ``eager`` / ``iter`` (the ``FETCH_MODES`` registry);
* :mod:`knitdata.consumer.collate`: :class:`~knitdata.consumer.collate.TokenCollator` and
  :class:`~knitdata.consumer.collate.MicroBatch`;
* :mod:`knitdata.consumer.prefetch` and :mod:`knitdata.consumer.staging`: the bounded prefetch thread, pinned
  staging buffers and side-stream host-to-device copies;
* :mod:`knitdata.consumer.handoff`: leases (fencing) and the background sender of hand-outs, commits and versions.

The fetch modes, the prefetcher and the sender are what an engine's read and report use, so they sit below the
engines; the dataset and its session sit above them (``tests/test_package.py`` checks the layers).
"""
