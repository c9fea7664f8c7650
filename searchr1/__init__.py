"""Cross-service plumbing for searchr1: configuration loading, the HTTP service helper,
structured logging, the Redis trajectory bus and the command-line entry point.

Kept deliberately small: anything specific to one service lives in that service's package.
"""

__version__ = "0.1.0"
