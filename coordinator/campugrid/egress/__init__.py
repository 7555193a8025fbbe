"""The way out of a build: an HTTP proxy that lets RUN steps (and ADD <url>) reach package
registries and nothing else. The platform runs one beside its caches (`campugrid up`); each
agent runs one per build in front of it, which the build's closed network reaches and which
writes every connection into the build log. Standard library only: both sides run it."""
