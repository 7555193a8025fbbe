"""Image builders for untrusted Dockerfiles: every RUN step executes inside gVisor, offline."""
