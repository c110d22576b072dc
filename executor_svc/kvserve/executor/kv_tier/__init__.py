"""The disk tier of the prefix cache: KV blocks kept in a local directory across restarts and beyond the pool.

- `block_file`: one block's file: a verified header (magic, version, fingerprint, key, length,
  checksums) and the payload, written atomically;
- `block_layout`: where the files live (a folder per fingerprint, fanned out by key), the start-up
  scan, and the lock that lets one store write a folder;
- `block_index`: the blocks held, by size, least recently used first;
- `disk_store`: `DiskBlockStore`, the bounded LRU store: `put` queued to a writer thread, `get`
  verified, read-only instead of failing.
"""
