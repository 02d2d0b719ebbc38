"""The HTML report of `fuselm report`: the page and its SVG drawings."""
