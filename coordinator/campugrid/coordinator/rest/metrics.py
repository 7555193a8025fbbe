"""/metrics: Prometheus scrapes with a bearer token, admins mint and revoke them."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from campugrid.coordinator.metrics import CONTENT_TYPE
from campugrid.coordinator.rest.deps import Admin, Coord, SiteDep
from campugrid.coordinator.rest.models import NewScrapeTokenOut, ScrapeTokenIn, ScrapeTokenOut
from campugrid.protocol.errors import Unauthenticated

router = APIRouter()


@router.get("/metrics", include_in_schema=False)
def scrape(request: Request, site: SiteDep) -> Response:
    """Prometheus text format; needs `Authorization: Bearer <scrape token>`, not a signature
    (auth.PUBLIC)."""
    try:
        body = site.coord.metrics.scrape(request.headers.get("authorization", ""))
    except Unauthenticated as e:
        address = request.client.host if request.client else "?"
        refused = site.guard.failed(address, "", str(e), why="scrape_token")
        return JSONResponse({"detail": str(refused)}, status_code=401,
                            headers={"www-authenticate": 'Bearer realm="campugrid metrics"'})
    return Response(body, media_type=CONTENT_TYPE)


@router.get("/v1/metrics/tokens", response_model=list[ScrapeTokenOut])
def list_scrape_tokens(_: Admin, coord: Coord) -> list[ScrapeTokenOut]:
    return [ScrapeTokenOut.of(t) for t in coord.metrics.tokens.all()]


@router.post("/v1/metrics/tokens", status_code=201, response_model=NewScrapeTokenOut)
def mint_scrape_token(body: ScrapeTokenIn, who: Admin, coord: Coord) -> NewScrapeTokenOut:
    """A scrape token for /metrics, shown this once (Prometheus: `authorization: {type:
    Bearer, credentials_file: …}`)."""
    token, made = coord.metrics.tokens.mint(body.name, who.id)
    return NewScrapeTokenOut(**ScrapeTokenOut.of(made).model_dump(), token=token)


@router.delete("/v1/metrics/tokens/{name}")
def revoke_scrape_token(name: str, _: Admin, coord: Coord) -> dict[str, bool]:
    """/metrics refuses the token from now on."""
    return {"revoked": coord.metrics.tokens.revoke(name)}
