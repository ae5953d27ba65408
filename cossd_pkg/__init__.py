"""cossd: a userspace emulator of a computational SSD that runs Adam inside the drive.

Subpackages, in dependency order (each imports only those below it):
tools -> fs -> emulator -> kernels; trainer speaks only the file API of a mount.
"""

__version__ = "0.1.0"
