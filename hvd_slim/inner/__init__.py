"""How the wrapped optimizer steps on what the exchange delivers (Adam: inner/adam.py)."""
