"""The web console: server-rendered pages for researchers and admins, served by the
coordinator under /console (jobs, submit, machines), signed in with a password and TOTP."""
