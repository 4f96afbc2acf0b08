"""surgery: model surgery for Hugging Face transformers."""

__version__ = "0.1.0"
