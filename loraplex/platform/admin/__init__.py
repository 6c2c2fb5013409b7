"""The admin API: tenants, keys, models, adapters and blobs, budgets, prices, engine stats, `auto` calibration."""
