"""torch.distributed.checkpoint by reference: a device snapshot in place of the moments, on one device (reference.py) or a group of devices (group.py)."""
