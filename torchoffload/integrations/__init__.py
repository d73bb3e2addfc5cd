"""Integrations with training loops that need one (Hugging Face `Trainer`: `hf`)."""
