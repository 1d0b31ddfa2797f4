"""Rendering results for people: text tables, JSON, CSV and plots. Nothing here measures."""
