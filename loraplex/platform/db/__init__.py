"""Storage: SQLAlchemy 2 async tables, engine/session set-up, Alembic upgrades, scratch databases."""
