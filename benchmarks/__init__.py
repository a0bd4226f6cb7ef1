"""Benchmarks of vllm-xmix (not part of the installed package): see benchmarks/README.md."""
