"""The archive tier: snapshots uploaded by the device to an S3-compatible object store, and namespaces restored from them.

store.py: S3 locations, the boto3 client that counts the device's network bytes, the store's
errors as statuses; versions.py: an archived version (the upload job, its manifest, the
listing); restore.py: disaster recovery (a namespace rebuilt from a version, every checksum
verified first); policy.py: the automatic policy (a snapshot every K steps, retention);
commands.py: ARCHIVE, ARCHIVE_LIST and log page C4h (loaded by the controller by name,
COMMAND_MODULES); metrics.py: its Prometheus figures. They import the namespace and its
snapshot store, the snapshots package (clone's records), the device's lower modules and
cossd.protocol; nothing in the device imports them but the controller (by name) and
emulator/metrics/figures.py. boto3 is optional (the `tiers` extra).
"""
