"""Decisions: the pure rollback policy (ledger, ranges, plan) and the remedies."""
