"""Tenants, API keys, base models and tenant adapters: the rows behind the API.

Each function is one unit of work on an AsyncSession: it validates first, writes, and commits,
or raises PlatformError with nothing written. The admin API and the CLI both call these.
"""
