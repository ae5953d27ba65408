"""Admin tools: the `cossd` command line (nvme-cli style) and the control-file client."""
