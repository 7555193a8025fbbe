"""The REST API under /v1, a router per noun: `jobs` (submit, read, cancel, logs, output,
uploads), `machines` (machines and what they share), `people` (apps, invites, the console's
people) and `metrics` (/metrics and its scrape tokens); `models` (what they take and answer)
and `deps` (who is calling, and the site they reach). `coordinator/api.py` puts them into one
application with its middleware and the console."""
