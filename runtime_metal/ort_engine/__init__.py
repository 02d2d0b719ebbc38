"""The onnxruntime engine: sessions, the in-memory CPU lowering and its Q4 and KV helpers."""
