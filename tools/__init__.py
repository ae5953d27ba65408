"""Admin tools: the `cossd` command line (nvme-cli style), a client of cossd.client.

Imports cossd.client and cossd.protocol; only the device verbs (tools/verbs/device.py: format,
mount, list) reach cossd.fs and cossd.emulator, and the demo and bench verbs the harnesses
(cossd.harness). The import contracts in pyproject.toml check it and say why for each import.
"""
