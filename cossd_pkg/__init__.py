"""cossd: a userspace emulator of a computational SSD that runs Adam inside the drive.

Subpackages, in dependency order (each imports only those below it; pyproject.toml's
[tool.importlinter] contracts check it): tools, trainer, integrations, fs, then emulator and
client (independent), then kernels and protocol (independent). The clients (client, the
trainer's optimizers, tools but the mount verb) import cossd.client and cossd.protocol only.
"""

__version__ = "0.1.0"
