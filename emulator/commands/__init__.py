"""Admin commands that are not one subsystem's own: CMB_WRITE/CMB_READ (cmb.py) and INJECT_ERROR (injection.py); the controller finds them through COMMAND_MODULES."""
