"""cossd.trainer: PyTorch optimizers that keep their state on a cossd device, and the demo."""
from .namespace_files import DeviceLostError
from .optim import Adam, AdamW

__all__ = ["Adam", "AdamW", "DeviceLostError"]
