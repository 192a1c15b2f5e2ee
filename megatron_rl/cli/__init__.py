"""The command line: ``python -m megatron_rl <command>`` (:mod:`megatron_rl.cli.app`) and the
tools that are commands only: the layout-parity ``check``, ``repro`` and ``sweep``."""
