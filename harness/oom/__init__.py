"""The OOM bench's parts outside the bench section itself: the throttled sink, the targets (object store, mounted device) and one trainer worker."""
