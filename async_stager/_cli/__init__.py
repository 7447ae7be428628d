"""The command line (``python -m async_stager``) and the benchmark behind it.

``main``: the parser and subcommands; ``bench``, ``args``, ``measure``, ``report``,
``workloads``: the side-by-side benchmark against PyTorch DCP's ``DefaultStager``.
Nothing in the library imports this package.
"""
