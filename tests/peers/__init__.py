"""Tests vendored from other projects (each folder names its source and license)."""
