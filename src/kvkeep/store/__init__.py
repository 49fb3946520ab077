"""Storage tiers: a shared-memory RAM arena, a crash-safe disk tier, and the tiered store."""
