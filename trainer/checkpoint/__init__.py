"""The tiered checkpointer (TieredCheckpointer, tiered.py): checkpoints of a trainer's state that is not offloaded, through a memory pool, a spill dir and an S3 store.

It never touches the optimizer: it takes state dicts. Its parts: state.py (the bookkeeping:
versions, where each lives, the pool's and spill dir's use), upload.py (the upload thread),
restore.py (the newest complete version, checked, then loaded), policy.py (the store's
measured rates, the AIMD concurrency, coalescing), store.py (the S3 store, boto3), spill.py
(the spill dir), payload.py (a version's state dicts as one buffer). They import
cossd.protocol (pacing, the manifest seal), cossd.model (the pool profiles), torch and the
standard library, not the rest of cossd.trainer; cossd.trainer exports TieredCheckpointer.
"""
