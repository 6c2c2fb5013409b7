"""Token budgets of tenants and keys: set (insert or replace), list, delete, and the rules a key
is checked against. One budget per tenant (or key) and period."""

from __future__ import annotations

from sqlalchemy import or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.billing.budgets import BudgetError, BudgetRule
from loraplex.billing.periods import PeriodError, check_budget_period
from loraplex.platform.db.tables import ApiKey, Budget, Tenant, utcnow
from loraplex.platform.errors import invalid, not_found, shown
from loraplex.platform.tenancy.common import commit_or_conflict
from loraplex.platform.tenancy.keys import PREFIX_LEN
from loraplex.platform.tenancy.tenants import get_tenant

MAX_LIMIT_TOKENS = 2**53 - 1  # counted exactly by the Redis counters' Lua numbers (and far below BIGINT's)


def rule_of(row: Budget) -> BudgetRule:
    return BudgetRule("tenant" if row.key_id is None else "key", row.period, row.limit_tokens, row.soft_limit_tokens)


async def _key_of(session: AsyncSession, tenant: Tenant, prefix: str) -> ApiKey:
    row = (await session.execute(select(ApiKey).where(ApiKey.prefix == prefix[:PREFIX_LEN]))).scalar_one_or_none()
    if row is None or row.tenant_id != tenant.id:
        raise not_found(f"tenant {tenant.name!r} has no key with prefix {prefix[:PREFIX_LEN]!r}", "key")
    return row


async def _scope(session: AsyncSession, tenant_name: str, key_prefix: str | None) -> tuple[Tenant, ApiKey | None]:
    tenant = await get_tenant(session, tenant_name)
    return tenant, (await _key_of(session, tenant, key_prefix) if key_prefix else None)


def _find(tenant: Tenant, key: ApiKey | None, period: str):
    return select(Budget).where(Budget.tenant_id == tenant.id, Budget.period == period,
                                Budget.key_id == key.id if key else Budget.key_id.is_(None))


async def set_budget(session: AsyncSession, tenant_name: str, period: str, limit_tokens: int,
                     soft_limit_tokens: int | None = None, key_prefix: str | None = None) -> Budget:
    """Creates or replaces the budget of a tenant (or of one of its keys) for `period`."""
    rule = BudgetRule("key" if key_prefix else "tenant", period, limit_tokens, soft_limit_tokens)
    try:
        rule.validate()
    except BudgetError as exc:
        raise invalid(str(exc), exc.param) from None
    if limit_tokens > MAX_LIMIT_TOKENS:  # soft_limit_tokens is no larger, as validated
        raise invalid(f"limit_tokens must be at most {MAX_LIMIT_TOKENS}, got {shown(str(limit_tokens))}",
                      "limit_tokens")
    tenant, key = await _scope(session, tenant_name, key_prefix)

    async def work() -> Budget:
        row = (await session.execute(_find(tenant, key, period))).scalar_one_or_none()
        if row is None:
            row = Budget(tenant_id=tenant.id, key_id=key.id if key else None, period=period)
            session.add(row)
        row.limit_tokens, row.soft_limit_tokens, row.updated_at = limit_tokens, soft_limit_tokens, utcnow()
        await session.flush()
        row.tenant, row.key = tenant, key
        return row

    return await commit_or_conflict(session, f"a {period} budget for this {rule.scope}", work)


async def delete_budget(session: AsyncSession, tenant_name: str, period: str, key_prefix: str | None = None) -> Budget:
    try:
        check_budget_period(period)
    except PeriodError as exc:
        raise invalid(str(exc), exc.param) from None
    tenant, key = await _scope(session, tenant_name, key_prefix)
    row = (await session.execute(_find(tenant, key, period))).scalar_one_or_none()
    if row is None:
        raise not_found(f"no {period} budget for {'key ' + key.prefix if key else 'tenant ' + tenant.name}", "period")
    await session.delete(row)
    await session.commit()
    return row


async def list_budgets(session: AsyncSession, tenant_name: str | None = None) -> list[Budget]:
    query = select(Budget).order_by(Budget.tenant_id, Budget.key_id.is_not(None), Budget.key_id, Budget.period)
    if tenant_name is not None:
        query = query.where(Budget.tenant_id == (await get_tenant(session, tenant_name)).id)
    return list((await session.execute(query)).scalars())


async def rules_for_key(session: AsyncSession, tenant_id: int, key_id: int) -> tuple[BudgetRule, ...]:
    """The budgets a request with this key is checked against: its tenant's and its own."""
    query = select(Budget).where(Budget.tenant_id == tenant_id, or_(Budget.key_id.is_(None), Budget.key_id == key_id))
    return tuple(rule_of(row) for row in (await session.execute(query)).scalars())
