"""How the CLI prints a job and a machine for people (--json prints the API's own)."""

from __future__ import annotations

from typing import Any

from campugrid.cli.follow import size_text


def job_text(job: dict[str, Any]) -> str:
    lines = [f"job      {job['id']}" + (f"  ({job['name']})" if job.get("name") else "")]
    shards = job.get("shards")
    if shards:
        lines.append(f"state    {job['state']}  ({shards['total']} shards: {shards['queued']} "
                     f"queued, {shards['running']} running, {shards['done'] - shards['failed']} "
                     f"succeeded, {shards['failed']} failed)")
    elif job.get("replicas") is not None:
        lines.append(f"state    {job['state']}  (verified: {len(job['replicas'])} replicas)")
    else:
        lines.append(f"state    {job['state']}  (attempt {job['attempt']} of {job['max_attempts']})")
    if job.get("tainted"):
        lines.append(f"TAINTED  {job['tainted']}")
    if job.get("replica_of"):
        lines.append(f"replica  of the verified job {job['replica_of']}")
    if job.get("waiting_reason"):
        lines.append(f"waiting  {job['waiting_reason']}")
    if job.get("reason"):  # once, with its own line breaks (a build log's tail)
        lines.append("reason   " + "\n         ".join(str(job["reason"]).splitlines()))
    if job.get("exit_code") is not None and job["exit_code"] >= 0:  # -1: no process exited
        lines.append(f"exit     {job['exit_code']}")
    if job.get("result"):
        lines.append(f"result   {job['result']}")
    files = job.get("output_files") or []
    if files:
        shown = ", ".join(f"{path} ({size_text(size)})" for path, size in files[:5])
        lines.append(f"output   {shown}" + (f", and {len(files) - 5} more" if len(files) > 5
                                             else "")
                     + f"  (campugrid output {job['id'][:8]} -o out.tar.gz)")
    for r in job.get("replicas") or []:
        said = (f"exit {r['exit_code']}, result {r['result'] or ''!r}, output "
                f"{(r['output_digest'] or 'none')[:19]}" if r["exit_code"] is not None
                else "no answer")
        verdict = {True: "agreed", False: "DISAGREED", None: ""}[r["agreed"]]
        lines.append(f"replica  {r['id'][:8]} on {(r['machine_id'] or '-')[:8]:<8} "
                     f"{r['state']:<9} {said}  {verdict}".rstrip())
    for c in job.get("checkpoints") or []:
        check = {"agreed": "checked: agreed", "rejected": "checked: REJECTED",
                 "disputed": "checked: DISPUTED", "checking": "checking"}.get(c["verdict"], "")
        start = f"epoch {c['resumed_from']}" if c["resumed_from"] is not None else "the start"
        named = f"  {c['label']}" if c.get("label") else ""
        lines.append(f"ckpt     epoch {c['epoch']:<5} #{c['attempt']:<3} on "
                     f"{(c['machine_id'] or '-')[:8]:<8} from {start:<11} "
                     f"{size_text(c['size']):>9}  {check}".rstrip() + named)
    for ref, digest in (job.get("bases") or {}).items():
        lines.append(f"base     {ref}@{digest}")
    for limit, how in (job.get("limits") or {}).items():
        if how != "enforced":
            lines.append(f"limit    {limit}: {how}")
    for ev in job.get("events") or []:  # one line each: a long reason is printed above
        first, *more = str(ev["detail"]).splitlines() or [""]
        lines.append(f"  {ev['at'][:19]}  #{ev['attempt']}  {ev['kind']:<14} {first}"
                     + (" (…)" if more else ""))
    return "\n".join(lines)


def machine_line(m: dict[str, Any]) -> str:
    """One machine: who, whether it is online (and busy, or held), and what it can give."""
    now = ("busy with job " + m["busy"] if m.get("busy") else "held" if m.get("held")
           else "idle") if m.get("online") else "offline" if m["status"] == "approved" else ""
    size = (f"{m['cpus']} CPUs, {size_text(m['memory_mb'] * 2**20)} memory, "
            f"{size_text(m['disk_mb'] * 2**20)} disk" if m.get("cpus") else "size not reported")
    return (f"{m['id']}  {m['status']:<11} {now:<22} {m['name']}  {size}\n"
            f"    {m['fingerprint']}  (from {m['address'] or '?'}, seen {m['last_seen_at'][:19]}"
            + (f", owner {m['owner']}" if m.get("owner") else "")
            + (f", {m['runtime']}" if m.get("runtime") else "") + ")"
            + (f"\n    held by its owner: {m['held']}" if m.get("held") else "")
            + (f"\n    answered against quorums {m['disagreed']} time(s), agreed {m['agreed']}; "
               f"quarantined: {m['quarantine']}\n    reinstate: campugrid machines approve "
               f"{m['id'][:8]}   or revoke: campugrid machines revoke {m['id'][:8]}"
               if m.get("quarantine") else ""))
