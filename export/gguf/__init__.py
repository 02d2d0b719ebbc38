"""GGUF input: the file's header and tensors, its config and tokenizer, read as a checkpoint."""
