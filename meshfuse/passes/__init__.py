"""Passes over a fusion; each is a small function, run in order by ``pipeline``."""
