"""Runs untrusted job containers: rootless Podman with gVisor's runsc, no network, bounded disk."""
