"""The peer pool's figures, named once: what a node counts, what its metrics report, and
what ``/metrics`` exports (``kvconnect_peer_<name>_total`` counters, ``kvconnect_peer_<name>``
gauges)."""

COUNTERS = ("write_requests", "writes_stored", "write_failures", "bytes_written", "read_requests",
            "read_hits", "read_local_hits", "read_remote_hits", "read_disk_hits", "read_misses",
            "read_failures", "read_timeouts", "read_stale", "bytes_read", "exists_requests",
            "exists_hits", "evictions", "promotes", "directory_republishes", "publish_failures",
            "rpc_failures", "bounce_reads", "staged_reads", "write_timeouts", "write_transfer_failures",
            "write_spills", "shared_reads")
"""Counted by the node as things happen."""

MEMBERSHIP_COUNTERS = ("membership_calls", "membership_failures", "membership_snapshots")
"""Counted by the membership: its calls (heartbeats, registry beats), those unanswered in
time, and full reads of the live set (a registry's only O(pool) call)."""

DISK_COUNTERS = ("disk_writes", "disk_evictions")
"""Counted by the disk tier (present only with one)."""

GAUGES = ("members", "pool_keys", "pool_bytes_used", "pool_capacity_bytes", "directory_entries",
          "disk_keys", "disk_bytes_used", "shared_segments_mapped")
"""Read from the node's state at scrape time."""
