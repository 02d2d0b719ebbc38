"""Prompts the speculative-decoding tests and benchmarks/spec_bench.py share: an `edit`
workload (the reply repeats its input with a change, where prompt lookup drafts whole runs of
it) and a `chat` one (a reply that shares little with its prompt)."""

CODE = '''def area(shape, width, height=None):
    """The area of a rectangle, a square or a triangle."""
    if shape == "square":
        return width * width
    if shape == "rectangle":
        if height is None:
            raise ValueError("a rectangle needs a height")
        return width * height
    if shape == "triangle":
        if height is None:
            raise ValueError("a triangle needs a height")
        return width * height / 2
    raise ValueError(f"unknown shape {shape}")


def total_area(shapes):
    total = 0
    for shape, width, height in shapes:
        total += area(shape, width, height)
    return total


def largest(shapes):
    best = None
    for shape, width, height in shapes:
        a = area(shape, width, height)
        if best is None or a > best[0]:
            best = (a, shape)
    return best
'''

WORKLOADS = {
    "edit": "Rewrite this Python code with the function `area` renamed to `shape_area` "
            "everywhere. Reply with the whole code only.\n\n```python\n" + CODE + "```",
    "chat": "Explain in a few paragraphs why the sky is blue and why sunsets are red.",
}
