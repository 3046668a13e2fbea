"""`ladle router`: an OpenAI-compatible front that spreads requests over worker servers.

It speaks only HTTP to its workers (any OpenAI-compatible server), so nothing here imports the
engine, the model or the server. `build_app(RouterConfig(...))` (ladle.router.app) gives the
FastAPI app; `ladle router` (ladle.router.cli) runs it.
"""

from ladle.router.config import POLICIES, RouterConfig

__all__ = ["POLICIES", "RouterConfig"]
