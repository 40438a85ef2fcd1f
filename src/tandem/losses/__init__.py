"""Policy-gradient losses."""
