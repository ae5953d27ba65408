"""cossd.server: the device's network front-end (beside the FUSE one): NVMe/TCP-framed connections served through the device's one I/O entry (emulator/io.py)."""
