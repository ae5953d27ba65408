"""Admin tools: the `cossd` command line (nvme-cli style), a client of cossd.client.

Imports cossd.client and cossd.protocol; only the mount verb (and the demo and bench verbs,
through the trainer's harnesses) reaches cossd.fs and cossd.emulator. The import contracts
in pyproject.toml check it, and list what is left (issue 15: remaining).
"""
