"""HF safetensors checkpoints: headers and shard indexes checked before any tensor is read."""
