"""Integrations with trainers, models and formats (Accelerate, Hugging Face transformers, webdataset)."""
