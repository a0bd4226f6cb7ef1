"""``vllm-xmix serve``'s launch of vLLM's OpenAI server: vLLM's ``serve`` subcommand itself
(``ServeSubcommand.cmd`` on arguments parsed by its own parser), so ``--api-server-count``,
``--headless`` and the data-parallel modes behave as with ``vllm serve``. Not
``python -m vllm.entrypoints.openai.api_server``, which starts one API server whatever
``--api-server-count`` says, nor the ``vllm`` command, whose main fails on the CPU wheel before
it parses anything (it looks up the version of a distribution named ``vllm``). Patches nothing."""

from __future__ import annotations


def run_vllm_serve(argv: list[str], prog: str = "vllm-xmix") -> None:
    """Run vLLM's OpenAI server with ``argv`` (``vllm serve``'s arguments: the model first, as
    its positional ``model_tag``, then options; ``--model`` works too, with vLLM's warning that
    it is deprecated there):
    the ``serve`` subcommand's own parser, check and command, as vLLM's CLI runs them (their
    modules moved between vLLM versions; the subcommand's methods did not). Returns when the
    server stops.

    Raises:
        SystemExit: arguments vLLM's parser refuses (its usage message)."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    root = FlexibleArgumentParser(prog=prog)
    serve = ServeSubcommand()
    serve.subparser_init(root.add_subparsers(dest="subparser"))
    args = root.parse_args([serve.name] + argv)
    serve.validate(args)
    serve.cmd(args)
