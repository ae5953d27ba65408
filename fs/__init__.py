"""The FUSE front-end: pyfuse3 + trio; maps paths to device calls and errors to errno.

Imports cossd.emulator (never the other way round); owns the event loop and the threads.
"""
