"""The provider agent: runs as an unprivileged user, dials out, runs one sandboxed task at a time."""
