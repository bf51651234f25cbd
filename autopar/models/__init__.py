"""Small plain-torch models used by ``autopar.examples`` (no Hugging Face dependency)."""
