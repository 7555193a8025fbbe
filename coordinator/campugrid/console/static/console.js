// Live job page: follow the job's server-sent events (logs, state), no polling.
"use strict";
// Destructive and trust actions (cancel, approve, revoke) ask once before they are sent.
document.addEventListener("submit", (ev) => {
  const form = ev.target;
  if (form.dataset && form.dataset.confirm && !window.confirm(form.dataset.confirm)) {
    ev.preventDefault();
  }
});
(function () {
  const job = document.getElementById("job");
  if (!job || !job.dataset.stream) return;
  const logs = { build: document.getElementById("build-log"), run: document.getElementById("run-log") };
  const status = document.getElementById("stream-status");
  const source = new EventSource(job.dataset.stream);
  source.addEventListener("log", (ev) => {
    const chunk = JSON.parse(ev.data);
    const pre = chunk.stream === "build" ? logs.build : logs.run;
    const atEnd = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
    pre.append(document.createTextNode(chunk.text));
    if (atEnd) pre.scrollTop = pre.scrollHeight;
  });
  source.addEventListener("state", (ev) => {
    const s = JSON.parse(ev.data);
    const state = document.getElementById("job-state");
    state.textContent = s.state;
    state.className = "state " + s.state;
    document.getElementById("job-attempt").textContent = s.attempt + " of " + s.max_attempts;
    document.getElementById("job-machine").textContent = s.machine || "none";
    document.getElementById("job-waiting").textContent = s.waiting || "";
  });
  source.addEventListener("history", (ev) => {  // the attempts table, as it grows
    const body = document.querySelector("#events tbody");
    for (const e of JSON.parse(ev.data)) {
      const row = body.insertRow();
      row.className = "event " + e.kind;
      const when = document.createElement("time");
      when.dateTime = e.iso;
      when.textContent = e.at;
      row.insertCell().append(when);
      for (const text of [String(e.attempt), e.kind, e.detail]) {
        row.insertCell().textContent = text;
      }
    }
  });
  source.addEventListener("end", () => {
    source.close();
    status.textContent = "The job has ended.";
    window.location.reload();  // the final page: outputs, checkpoints, every attempt
  });
  source.addEventListener("signed-out", () => {
    source.close();
    status.textContent = "Your session has ended: sign in again to follow this job.";
  });
  source.onerror = () => { status.textContent = "Connection lost; reconnecting…"; };
  source.onopen = () => { status.textContent = "Live: new lines appear as the provider sends them."; };
})();
