"""Integrations with trainers and formats (Accelerate, webdataset)."""
