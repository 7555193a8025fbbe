"""Machines: who may work (admins list, invite, approve and revoke them), and what the
approved ones online share."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from campugrid.coordinator.rest.deps import Admin, Caller, Coord, SiteDep
from campugrid.coordinator.rest.models import JoinOut, MachineOut, SharedFileOut, ShareOut

router = APIRouter(prefix="/v1")


@router.get("/shares", response_model=list[ShareOut])
def shares(_: Caller, coord: Coord) -> list[ShareOut]:
    """What approved providers online share: each folder's files by path inside it, size
    and sha256 (name them in a dataset: {"name": ..., "share": ..., "sha256": {path:
    sha256}}), and on how many machines each is. Never where they are on a host."""
    return [ShareOut(name=name, files=[SharedFileOut(path=p, size=size, sha256=sha, machines=n)
                                       for (p, size, sha), n in sorted(files.items())])
            for name, files in sorted(coord.machines.shared().items())]


@router.get("/machines", response_model=list[MachineOut])
def list_machines(_: Admin, coord: Coord) -> list[MachineOut]:
    online = {v.id: v for v in coord.machines.online()}
    return [MachineOut.of(m, online.get(m.id)) for m in coord.machines.all()]


@router.get("/machines/join", response_model=JoinOut)
def join(_: Admin, site: SiteDep) -> JoinOut:
    return JoinOut(grpc_address=site.grpc_address, pin=site.pin,
                   command=f"campugrid agent join {site.grpc_address} --pin {site.pin}")


@router.post("/machines/{ref}/approve", response_model=MachineOut)
def approve(ref: str, _: Admin, coord: Coord,
            owner: Annotated[str | None, Query(max_length=200)] = None) -> MachineOut:
    """Approve (or reinstate) a machine; `owner`: whose machine it is (kept if not said)."""
    return MachineOut.of(coord.machines.approve(ref, owner))


@router.post("/machines/{ref}/revoke", response_model=MachineOut)
def revoke_machine(ref: str, _: Admin, coord: Coord) -> MachineOut:
    machine, _requeued = coord.machines.revoke(ref)
    return MachineOut.of(machine)
