"""How the wrapped optimizer steps on what the exchange delivers (Adam: optim/inner/adam.py)."""
