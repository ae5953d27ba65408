"""An optimizer namespace on a mounted device: its files and control file (files.py), and the atomic replacement of its state (swap.py)."""
