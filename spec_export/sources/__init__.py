"""Where models come from: a source (Hugging Face id, directory, GGUF file) or the
embedded default, what is checked of it before any library reads it, and loading it for export."""
