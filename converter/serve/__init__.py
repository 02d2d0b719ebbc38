"""`fuselm serve`: the OpenAI-compatible HTTP app, its request schema, scheduler and text stream."""
