"""Where models come from besides a user's folder: the hub, the built-in test models and
the demo's SmolLM2."""
