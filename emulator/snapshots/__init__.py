"""Snapshot commands and what they start: clone a snapshot into a namespace, export a namespace's or a snapshot's state.

commands.py holds the controller's handlers for SNAPSHOT_CREATE, DELETE, ROLLBACK, CLONE and
EXPORT (CBh-CFh) and log pages C1h and C2h (the controller loads it by name, COMMAND_MODULES);
clone.py makes a namespace from a snapshot; export.py writes safetensors files as background
jobs. Each namespace's snapshot store (SnapshotStore) is part of the namespace
(emulator/namespace/snapshots.py). They import the namespace, the device's lower modules and
cossd.protocol; nothing in the namespace imports them.
"""
