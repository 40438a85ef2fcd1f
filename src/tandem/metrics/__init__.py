"""Metric windows and where they are written."""
