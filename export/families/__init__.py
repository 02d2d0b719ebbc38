"""One small module per architecture family; each registers its HF class names."""
