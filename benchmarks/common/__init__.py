"""What several benchmark drivers share.

* :mod:`benchmarks.common.cli`: the ``python -m benchmarks`` command and the script entry of each driver;
* :mod:`benchmarks.common.output`: JSON, machine description, command line and small formatting helpers;
* :mod:`benchmarks.common.workload`: the transfer workload (groups of trajectories sharing an image, or a video
  and an audio clip) and its trajectories;
* :mod:`benchmarks.common.models`: the toy VLM (vision encoder + decoder), its presets and FLOP counting;
* :mod:`benchmarks.common.consumer`: a consumer's step loop, its trainers (CPU or calibrated accelerator wait)
  and its step records;
* :mod:`benchmarks.common.sources`: knitdata's consumers as step sources;
* :mod:`benchmarks.common.baselines`: the transferqueue baseline (server, client sources, streaming loader);
* :mod:`benchmarks.common.harness`: consumer worker processes, the worker pool, the Ray cluster driver;
* :mod:`benchmarks.common.summary`: the transfer result's summary, table and plot.
"""
