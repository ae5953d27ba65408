"""The `cossd` verbs, one module per family (device, namespace, admin, logs, ...), each with `register(verb)`.

tools/cli.py loads them by name (its VERBS table: each verb and its family). A verb module imports cossd.client,
cossd.protocol, cossd.model and the verbs' helpers (tools/arguments.py, tools/output.py), never
tools/cli.py; only device.py reaches cossd.fs, cossd.emulator and cossd.server, archive.py the
archive's store, and harness.py the harnesses (pyproject.toml's contracts name each import).
"""
