"""Renderers: each turns Result objects into one output format, without re-running the analysis."""
