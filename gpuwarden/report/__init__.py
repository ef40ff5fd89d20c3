"""`gpuwarden report`: one self-contained HTML page (and its JSON) of where a site's GPU time
went and what each of four design choices would change, from the site's own accounting.

collect: tallies filled in the same pass over the records as the lemon attribution;
stats: Poisson intervals; the sections (mttf, outcomes, ettr, tradeoffs, drains, lemons) are
pure functions of a History; build: all of them, as JSON-ready dataclasses; charts
(matplotlib's SVG backend) and render (jinja2) draw the page; cli: the command.
"""
