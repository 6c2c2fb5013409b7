"""Which model serves a request: a named model or adapter for its tenant, or `auto` by complexity."""
