"""The package version, read by the launch plan, the profile and the CLI (below every layer)."""

__version__ = "0.1.0"
