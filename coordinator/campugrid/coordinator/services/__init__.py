"""The coordinator's services, one per noun: `jobs` (what researchers submit and read),
`leasing` (what machines hold: leases, holds, checkpoints), `machines` (who may work, and how
they are), `apps` (apps, their keys and invites; the console's people) and `inputs`
(uploads and datasets); `supplies` (what a lease comes with to fetch through: caches,
the egress proxy, the bases' sources). `Coordinator` (service.py) puts them together on one store; REST,
the console and gRPC call only these, never the store."""
