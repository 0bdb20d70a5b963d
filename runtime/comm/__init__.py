"""Exchanges among ranks: point-to-point transport, agreement, shared-parameter sums, norms."""
