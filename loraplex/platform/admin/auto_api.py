"""Admin API for `auto`'s calibration: set the pool's limits for a traffic share, and the share
each model actually got per day (routing/learned/calibration.py)."""

from __future__ import annotations

from typing import Annotated

from litestar import get, post
from litestar.params import FromQuery, JSONBody
from msgspec import Meta, Struct

from loraplex.billing.usage import utcnow
from loraplex.platform.routing.learned import calibration
from loraplex.platform.state import PlatformDep

Share = Annotated[float, Meta(ge=0, le=1)]
MAX_POOL = 64


class CalibrateIn(Struct, kw_only=True):
    strong_share: Share | None = None  # the most capable model's share; the others split the rest
    shares: Annotated[dict[Annotated[str, Meta(max_length=200)], Share], Meta(max_length=MAX_POOL)] | None = None
    since: Annotated[str, Meta(max_length=16)] = "7d"  # the window of recorded scores
    dry_run: bool = False


class CalibrateOut(Struct):
    thresholds: dict[str, float]  # model -> auto_max_complexity set (or that would be, dry_run)
    shares: dict[str, float]  # asked for
    expected: dict[str, float]  # what the window's scores give each model under the new limits
    scores: int
    applied: bool


class DailyShare(Struct):
    day: str
    model: str
    requests: int
    share: float


@post("/auto/calibrate", status_code=200)
async def calibrate_auto(platform: PlatformDep, data: JSONBody[CalibrateIn]) -> CalibrateOut:
    """Sets auto's limits so the chosen share of the window's recorded traffic goes to each model."""
    window = calibration.parse_window(data.since)
    result = await platform.calibrate_auto(window, data.strong_share, data.shares, apply=not data.dry_run)
    return CalibrateOut(result.thresholds, result.shares, result.expected, result.scores, not data.dry_run)


@get("/auto/shares")
async def auto_shares(platform: PlatformDep, since: FromQuery[str] = "7d") -> list[DailyShare]:
    """The share of `auto`'s requests each model got, per UTC day, over the window."""
    window = calibration.parse_window(since)
    async with platform.sessions() as session:
        rows = await calibration.daily_shares(session, utcnow() - window)
    return [DailyShare(**r) for r in rows]


auto_handlers = [calibrate_auto, auto_shares]
