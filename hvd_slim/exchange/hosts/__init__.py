"""The hosts-first exchange (``hierarchical=True``): the ranks of a host sum their gradients
first and one leader per host runs the flat exchange (hierarchy.py); its host-local phases,
frames, flush and checkpoint beside it."""
