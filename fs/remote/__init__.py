"""The remote mount: a FUSE tree on a client node backed by a storage server (`cossd mount cossd://HOST:PORT MNT`): its daemon, its connections, its inode map and its handlers."""
