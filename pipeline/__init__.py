"""Config-driven speculative decoding pipeline: check, convert, build, run, deploy, serve, bench, profile."""

__version__ = "0.1.0"
