"""The browser playground at `/` (`ladle serve --no-webui` leaves it out): chat, decisions and live
metrics. Plain static files beside this module, calling the server's own API; nothing to build."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

from ladle.server.errors import APIError

HERE = Path(__file__).parent
ASSETS = {"app.js": "text/javascript", "style.css": "text/css"}  # only these: never this module's source

router = APIRouter(include_in_schema=False)


@router.get("/")
async def index() -> FileResponse:
    return FileResponse(HERE / "index.html", media_type="text/html")


@router.get("/webui/{name}")
async def asset(name: str) -> FileResponse:
    if name not in ASSETS:
        raise APIError(404, f"no playground file {name!r}")
    return FileResponse(HERE / name, media_type=ASSETS[name])
