"""ntx: stream Llama-family GGUF models larger than GPU memory through cooperating daemons."""

__version__ = "0.1.0"
