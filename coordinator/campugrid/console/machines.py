"""Machines, for admins: who may work, who is online, what each GPU's memory did in the
last hour; approve and revoke."""

from __future__ import annotations

import datetime as dt

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from campugrid.console import charts
from campugrid.console.pages import admin_of, csrf, pages

CHART_MINUTES = 60
private = APIRouter(dependencies=[Depends(csrf)])


@private.get("/machines", response_class=HTMLResponse)
def machines(request: Request) -> HTMLResponse:
    site = pages(request)
    admin_of(request)
    found = site.coord.machines.all()
    order = {"pending": 0, "approved": 1, "revoked": 2}
    found.sort(key=lambda m: (order.get(m.status.value, 3), m.name))
    online = {m.id: m for m in site.coord.machines.online()}
    recent = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=30)
    drawn: dict[str, list[charts.Chart]] = {}
    for chart in charts.charts(site.coord.machines.gpu_history(CHART_MINUTES)):
        drawn.setdefault(chart.machine_id, []).append(chart)
    return site.page(request, "machines.html", machines=found, online=online, recent=recent,
                     charts=drawn, minutes=CHART_MINUTES)


@private.post("/machines/{ref}/approve")
def approve(request: Request, ref: str) -> Response:
    site = pages(request)
    admin_of(request)
    site.coord.machines.approve(ref)
    return RedirectResponse(f"{request.scope.get('root_path', '')}/machines?done=approved",
                            303)


@private.post("/machines/{ref}/revoke")
def revoke(request: Request, ref: str) -> Response:
    site = pages(request)
    admin_of(request)
    site.coord.machines.revoke(ref)
    return RedirectResponse(f"{request.scope.get('root_path', '')}/machines?done=revoked",
                            303)
