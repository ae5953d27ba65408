"""cossd.harness: whole-stack harnesses (the demo, the bench) that format, mount and kill devices of their own; they may import every layer below tools."""
