"""What the benchmark drivers share, and the parts of the larger drivers.

* :mod:`benchmarks.common.cli`: the ``python -m benchmarks`` command and the script entry of each driver;
* :mod:`benchmarks.common.output`: the command line recorded in results, strict JSON files;
* :mod:`benchmarks.common.models`: the toy models (transfer's tiny VLM with its presets and FLOP counting,
  encode's transformer encoder and backbone, the demo's MLP models);
* the transfer benchmark's parts: :mod:`~benchmarks.common.workload` (the workload, its trajectories and the
  benchmark's vocabulary), :mod:`~benchmarks.common.consumer` (a consumer's step loop, its trainers and their
  calibration, knitdata's datasets as step sources), :mod:`~benchmarks.common.baselines` (transferqueue),
  :mod:`~benchmarks.common.engines` (knitdata's embedded run and the Ray cluster driver),
  :mod:`~benchmarks.common.harness` (consumer worker processes and their pool), :mod:`~benchmarks.common.summary`
  (the result's summary, table and plot);
* the soak benchmark's parts: :mod:`~benchmarks.common.soak_core` (configuration, ledger, the in-process run) and
  :mod:`~benchmarks.common.soak_processes` (the cross-process run on Ray).

Modules import downwards only: ``workload`` -> ``models``; ``consumer`` -> ``workload``, ``models``;
``engines`` -> ``consumer``; ``baselines`` -> ``engines``; ``harness`` -> ``baselines``, ``engines``;
``summary`` -> ``consumer``, ``models``, ``workload``.
"""
