"""Snapshot replicas on a buddy node: the daemon-to-daemon channel, the pusher that sends
this node's newest snapshots and the receiver that keeps the peers' (docs/snapshots.md)."""
