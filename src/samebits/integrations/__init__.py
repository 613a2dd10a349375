"""Callbacks for the trainers users already have (``hf``, ``lightning``): record a run without
writing a loop.  Each module imports its trainer library; this package imports neither.
See docs/integrations.md.
"""
