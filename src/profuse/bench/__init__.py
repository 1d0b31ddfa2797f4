"""Timing, statistics and byte models: the harness behind every number profuse reports."""
