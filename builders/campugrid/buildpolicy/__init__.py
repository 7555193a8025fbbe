"""What a job may hand a builder, read by campugrid's own code only: its Dockerfile
(`dockerfiles`, on BuildKit's parser) and its tarballs (`tarballs`: the build context, and the
checkpoint and file archives a job leaves). The coordinator checks a submission with it and
the agent checks and unpacks with it again; it imports nothing of the builders' machinery."""
