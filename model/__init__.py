"""cossd.model: the timing model of the device, its links and its media profiles (pure computation, imports only cossd.protocol), used by the emulator for --timed and by `cossd model`."""
